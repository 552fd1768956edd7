"""One safetensors file whose bytes depend only on its tensors and metadata: the feature store's shard format
(eaglepipe/data/features.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eaglepipe.atomic import atomic_path

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int32: "I32", torch.bool: "BOOL", torch.uint8: "U8"}


def save_shard(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a safetensors file whose bytes depend only on the tensors and metadata (atomic: ``path.tmp`` + rename).

    Tensors are laid out in sorted name order, the header JSON has sorted keys and is space-padded to a
    multiple of 8 bytes (as safetensors does); readable by ``safe_open`` / ``load_file``.
    Raises KeyError for a dtype outside :data:`_ST_DTYPES`.
    """
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with atomic_path(path, 8 + len(head) + offset) as tmp, open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for raw in blobs:
            f.write(raw)
