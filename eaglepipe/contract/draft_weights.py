"""A draft folder's weights read without torch: safetensors headers, and d2t / t2d checked with numpy.

``fc.weight`` and ``lm_head.weight`` are judged from their shapes in the header; ``d2t`` / ``t2d`` values are
read with numpy when it is there: offsets in range, target ids = arange + d2t strictly increasing, identity =
all zeros, t2d marking exactly the target ids d2t maps to. Used by :mod:`eaglepipe.contract.inspect`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


def safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file: {name: {"dtype", "shape", "data_offsets"}} (no torch)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    for meta in header.values():
        meta["_file"] = str(path)
        meta["_data_start"] = 8 + n
    return header


def draft_tensors(draft_dir: Path) -> dict:
    """Every tensor's header entry over the folder's ``*.safetensors`` files (shards in name order)."""
    out: dict = {}
    for path in sorted(draft_dir.glob("*.safetensors")):
        out.update(safetensors_header(path))
    return out


def find_tensor(tensors: dict, name: str) -> dict | None:
    """The header entry named ``name`` or ending in ``.name`` (formats prefix their tensors), else None."""
    for key, meta in tensors.items():
        if key == name or key.endswith("." + name):
            return meta
    return None


_NP_DTYPES = {"I64": "<i8", "I32": "<i4", "BOOL": "|b1", "U8": "|u1"}


def _read_values(meta: dict):
    """A 1-D tensor's values as a numpy array, or None when numpy is missing or the dtype is unexpected."""
    try:
        import numpy as np
    except ImportError:
        return None
    dtype = _NP_DTYPES.get(meta["dtype"])
    if dtype is None:
        return None
    start, end = meta["data_offsets"]
    with open(meta["_file"], "rb") as f:
        f.seek(meta["_data_start"] + start)
        return np.frombuffer(f.read(end - start), dtype=dtype)



def check_vocab(tensors: dict, draft_vocab: int | None, target_vocab: int | None, problems: list[str]) -> str:
    """A one-line verdict on d2t (offsets: target_id = draft_id + d2t[draft_id]) and t2d; what breaks serving
    is appended to ``problems``."""
    d2t_meta, t2d_meta = find_tensor(tensors, "d2t"), find_tensor(tensors, "t2d")
    if d2t_meta is None:
        if draft_vocab is not None and target_vocab is not None and draft_vocab < target_vocab:
            problems.append(f"no d2t tensor, but draft_vocab_size {draft_vocab} < target vocab {target_vocab}")
        return "d2t absent"
    if d2t_meta["dtype"] not in ("I64", "I32"):
        problems.append(f"d2t has dtype {d2t_meta['dtype']}; engines expect integer offsets (int64)")
        return "d2t not integer"
    if draft_vocab is not None and d2t_meta["shape"] != [draft_vocab]:
        problems.append(f"d2t shape {d2t_meta['shape']} != [draft_vocab_size] = [{draft_vocab}]")
    d2t = _read_values(d2t_meta)
    if d2t is None:
        return "d2t not read (numpy missing)"
    import numpy as np

    target_ids = np.arange(len(d2t), dtype=np.int64) + d2t.astype(np.int64)  # target_id = draft_id + d2t[draft_id]
    verdict = "identity (all zeros)" if not d2t.any() else f"offsets, {len(d2t)} draft tokens"
    bad = []
    if target_vocab is not None and (target_ids.min() < 0 or target_ids.max() >= target_vocab):
        bad.append(f"arange + d2t spans [{target_ids.min()}, {target_ids.max()}], outside [0, {target_vocab})")
        if d2t.min() >= 0 and d2t.max() < target_vocab and np.all(np.diff(d2t) > 0):
            bad.append("d2t looks like absolute target ids; engines add it to the draft id (offsets)")
    if len(target_ids) > 1 and not np.all(np.diff(target_ids) > 0):
        bad.append("arange + d2t is not strictly increasing (duplicate or unsorted target ids)")
    if t2d_meta is not None:
        t2d = _read_values(t2d_meta)
        if t2d is not None:
            if target_vocab is not None and len(t2d) != target_vocab:
                bad.append(f"t2d has {len(t2d)} entries, target vocab is {target_vocab}")
            elif int(t2d.sum()) != len(d2t):
                bad.append(f"t2d marks {int(t2d.sum())} tokens, d2t has {len(d2t)}")
            elif not bad and not t2d[target_ids].all():
                bad.append("t2d is False at some target id that d2t maps to")
    problems.extend(f"d2t: {b}" for b in bad)
    return "bad: " + "; ".join(bad) if bad else verdict
