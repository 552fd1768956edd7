"""Files written whole or not at all: written as ``<path>.tmp``, then renamed over ``path`` (``os.replace`` is
atomic on one file system), so a killed stage leaves the old file or the new one, never half of one.
Every writer in eaglepipe (feature shards, manifests, metrics, checkpoints, drafts, exports) goes through here.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from eaglepipe.errors import DiskFull

FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left on the device; disk quota exceeded


def is_full(e: BaseException) -> bool:
    """Whether ``e`` says the file system is full: an OSError with ENOSPC/EDQUOT, or a writer that wraps it
    (safetensors' SafetensorError "I/O error: No space left on device (os error 28)")."""
    return getattr(e, "errno", None) in FULL or any(
        f"os error {n}" in str(e) or os.strerror(n) in str(e) for n in FULL)


def _size(n: int | None) -> str:
    """Bytes in the largest binary unit that keeps them ≥ 1 ("24.0 KiB", "1.3 GiB")."""
    if n is None:
        return "an unknown amount"
    unit = next(u for u in range(4, -1, -1) if n >= 1024**u or u == 0)
    return f"{n / 1024**unit:,.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][unit]}"


def disk_full(path: Path, need: int | None, whole_folder: bool = False) -> DiskFull:
    """The DiskFull for a write of ``need`` bytes (None: unknown) to ``path`` that ran out of space: the file, the
    bytes needed and free on its file system (``shutil.disk_usage``), and the finished files beside it (a stage's
    shards or checkpoints), kept for the rerun. ``whole_folder``: ``path`` is a folder written whole
    (:func:`atomic_dir`), of which ``need`` bytes had been written."""
    where = next((q for q in (path, *path.parents) if q.exists()), Path("."))
    free = shutil.disk_usage(where).free
    if whole_folder:
        needed, kept = f"more than {_size(need)}", "nothing of it was kept"
    else:
        done = [f for f in path.parent.glob("*") if f.is_file() and not f.name.endswith(".tmp")]
        needed, kept = _size(need), f"Kept for the rerun: {len(done)} finished files in {path.parent}"
    return DiskFull(f"no space left on the device writing {path}: {needed} needed, {_size(free)} free on the file "
                    f"system of {where}. The unfinished file was removed. {kept} (eaglepipe/atomic.py writes each "
                    "file whole). Free space (or point data/ at a larger disk) and rerun: the stage resumes from its "
                    "finished work")


@contextmanager
def atomic_path(path: str | Path, size: int | None = None) -> Iterator[Path]:
    """Yield ``<path>.tmp`` to write; when the block ends without error rename it over ``path``, else remove it.
    ``size``: the bytes the block writes, where known. A full file system (ENOSPC, EDQUOT) raises
    :class:`DiskFull` (:func:`disk_full`) instead of the OSError."""
    tmp = Path(str(path) + ".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if is_full(e):
            raise disk_full(Path(path), size) from None
        raise


def atomic_write_json(path: str | Path, obj) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2) + "\n")


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty folder ``<path>.tmp`` to fill; when the block ends without error it replaces the folder
    ``path`` (the old one is removed first, so the swap is not atomic, but ``path`` is never half-written).
    A full file system raises :class:`DiskFull` (:func:`disk_full`), the partial folder removed."""
    path = Path(path)
    tmp = Path(str(path) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except DiskFull:  # a file inside (atomic_path) said so already
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException as e:
        if not is_full(e):
            raise
        written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_full(path, written, whole_folder=True) from None
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
