"""What every stage script shares: logging set-up, params loading with a clean failure, its inputs checked, errors
as one line (never a traceback for a missing input, a full disk or memory running out), metric writing."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from eaglepipe.atomic import atomic_write_json
from eaglepipe.errors import EaglepipeError, InputMissing, ParamsError
from eaglepipe.params import Params, load_params

# The pipeline's outputs that stages read, and the stage that writes each (dvc.yaml's outs; tests/test_stage_inputs.py
# checks the two agree).
WRITTEN_BY = {"data/params_ok.json": "check_params", "data/target": "target", "data/unquantized": "target",
              "data/prompts": "prompts", "data/features": "extract", "data/validated.json": "validate_offsets",
              "data/drafter": "train_drafter", "data/export": "export"}


def writer_of(path: str | Path) -> str | None:
    """The stage whose dvc.yaml out holds ``path`` (relative to the repo root), or None."""
    path = Path(path).as_posix()
    return next((stage for out, stage in WRITTEN_BY.items() if path == out or path.startswith(out + "/")), None)


def require_inputs(*paths: str | Path) -> None:
    """Raise InputMissing for the first of ``paths`` that does not exist, naming the stage that writes it and the
    command that makes it (``dvc repro <stage>``)."""
    for path in paths:
        if not Path(path).exists():
            stage = writer_of(path)
            how = (f"stage `{stage}` writes it: run `dvc repro {stage}` (or `dvc repro` for the whole pipeline)"
                   if stage else "it is not written by any stage of dvc.yaml: check the path")
            raise InputMissing(f"stage `{_stage()}` reads {path}, which does not exist; {how}")


def _stage() -> str:
    """This process's stage: its script's name (stages/<stage>.py)."""
    return Path(sys.argv[0]).stem


def start(name: str) -> Params:
    """Configure logging and return validated params; on a params error print it and exit 2 (nothing written)."""
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(levelname)s %(name)s: %(message)s")
    try:
        return load_params()
    except EaglepipeError as e:
        _say(str(e))
        raise SystemExit(2)


def scratch_dir_of(out_dir: str | Path) -> Path:
    """Where a stage keeps the unfinished work (shards, checkpoints) of the output it writes to ``out_dir``:
    beside it under ``.scratch/`` (data/drafter → data/.scratch/drafter), outside what DVC hashes, so a run
    killed midway resumes it (extract's shards, train_drafter's checkpoints)."""
    out_dir = Path(out_dir)
    return out_dir.parent / ".scratch" / out_dir.name


def _say(message: str) -> None:
    """Print ``message`` and its newline to stderr in one write(2): the ranks of a torchrun launch share the
    stage's stderr, and a pipe keeps a write of up to PIPE_BUF (4 KiB) bytes whole, so their lines never mix."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured in-process)
        print(message, file=sys.stderr)
        return
    data = (message + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def run(main) -> None:
    """Call ``main()``; an EaglepipeError becomes its message on stderr (no traceback) and exit code 2 for a
    params/target problem (ParamsError, e.g. a target family or RoPE no engine can serve), else 1 (a full disk
    while writing through eaglepipe/atomic.py is a DiskFull). So do, as one line and exit 1, what no check can
    foresee: a file missing (FileNotFoundError, named with the stage that writes it), the disk filling up where a
    writer outside eaglepipe/atomic.py hit it (ENOSPC, EDQUOT) and memory running out (MemoryError,
    torch.OutOfMemoryError); files written whole before it stay for the rerun."""
    from eaglepipe.atomic import is_full

    try:
        main()
    except EaglepipeError as e:
        _say(f"error: {e}")
        raise SystemExit(2 if isinstance(e, ParamsError) else 1)
    except FileNotFoundError as e:
        stage = writer_of(e.filename) if e.filename else None
        how = f"; stage `{stage}` writes it: run `dvc repro {stage}`" if stage else ""
        _say(f"error: stage `{_stage()}`: no such file or folder: {e.filename or e}{how}")
        raise SystemExit(1)
    except OSError as e:
        if not is_full(e):
            raise
        _say(f"error: stage `{_stage()}`: no space left on the device ({e}). Free space and rerun: the stage "
             "resumes from the work it finished")
        raise SystemExit(1)
    except Exception as e:  # memory: MemoryError, torch.OutOfMemoryError (CUDA), known without importing torch
        if not isinstance(e, MemoryError) and type(e).__name__ != "OutOfMemoryError":
            raise
        _say(f"error: stage `{_stage()}` ran out of memory ({(str(e).splitlines() or [type(e).__name__])[0][:200]})"
             ". Lower its batch params (extract.batch_size, train.batch_tokens, serve.batch_sizes) or free memory, "
             "and rerun: it resumes from the work it finished")
        raise SystemExit(1)


def write_metrics(path: str | Path, metrics: dict) -> None:
    """Write a metrics JSON (atomically), creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, json.loads(json.dumps(metrics, default=str)))
