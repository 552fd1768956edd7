"""What every stage script shares: logging set-up, params loading with a clean failure, metric writing."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from eaglepipe.atomic import atomic_write_json
from eaglepipe.errors import EaglepipeError, ParamsError
from eaglepipe.params import Params, load_params


def start(name: str) -> Params:
    """Configure logging and return validated params; on a params error print it and exit 2 (nothing written)."""
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(levelname)s %(name)s: %(message)s")
    try:
        return load_params()
    except EaglepipeError as e:
        print(e, file=sys.stderr)
        raise SystemExit(2)


def scratch_dir_of(out_dir: str | Path) -> Path:
    """Where a stage keeps the unfinished work (shards, checkpoints) of the output it writes to ``out_dir``:
    beside it under ``.scratch/`` (data/drafter → data/.scratch/drafter), outside what DVC hashes, so a run
    killed midway resumes it (extract's shards, train_drafter's checkpoints)."""
    out_dir = Path(out_dir)
    return out_dir.parent / ".scratch" / out_dir.name


def run(main) -> None:
    """Call ``main()``; an EaglepipeError becomes its message on stderr (no traceback) and exit code 2 for a
    params/target problem (ParamsError, e.g. a target family or RoPE no engine can serve), else 1."""
    try:
        main()
    except EaglepipeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2 if isinstance(e, ParamsError) else 1)


def write_metrics(path: str | Path, metrics: dict) -> None:
    """Write a metrics JSON (atomically), creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, json.loads(json.dumps(metrics, default=str)))
