"""Files written whole or not at all: written as ``<path>.tmp``, then renamed over ``path`` (``os.replace`` is
atomic on one file system), so a killed stage leaves the old file or the new one, never half of one.
Every writer in eaglepipe (feature shards, manifests, metrics, checkpoints, drafts, exports) goes through here.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield ``<path>.tmp`` to write; when the block ends without error rename it over ``path``, else remove it."""
    tmp = Path(str(path) + ".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2) + "\n")


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty folder ``<path>.tmp`` to fill; when the block ends without error it replaces the folder
    ``path`` (the old one is removed first, so the swap is not atomic, but ``path`` is never half-written)."""
    path = Path(path)
    tmp = Path(str(path) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
