"""Training state as one safetensors file, read back without running any code: a checkpoint is data.

``torch.load`` unpickles, and unpickling calls whatever a file names, so a tampered checkpoint would run code at
the next resume. Here a *tree* — dicts, lists, tuples, ``None``, bools, ints, floats, strings and tensors, as in
``state_dict()``s, RNG states and the loop's counters — is split in two parts of one file:

- every tensor is a safetensors tensor named by its path in the tree, ``/``-joined
  (``optimizer/state/0/exp_avg``); a DTensor (FSDP2) is stored as this rank's local shard and its name listed in
  the file's metadata entry ``sharded``;
- everything else is JSON, stored as the UTF-8 bytes of the uint8 tensor :data:`JSON` (not in the metadata
  header, whose size safetensors' reader caps at 100 MB), a tensor written as ``{"__tensor__": name}``, a
  tuple as ``{"__tuple__": [...]}``, a dict whose keys are not all strings (an optimizer's ``state``, keyed by
  parameter index) as ``{"__items__": [[key, value], ...]}``.

Reading parses the safetensors header (JSON) and the JSON tree, then copies bytes into tensors; nothing is
imported or called by name. Floats survive exactly (JSON keeps Python's shortest round-trip repr; NaN and ±inf
are written as JSON's NaN / Infinity extensions). A file that is not such a tree (a pickle, a truncated file,
another format, a tree naming a tensor it lacks) is refused with :class:`eaglepipe.errors.TrainingError`
naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from eaglepipe.atomic import atomic_path
from eaglepipe.errors import TrainingError

FORMAT = "eaglepipe.checkpoint/1"  # the metadata entry "format" every such file carries
JSON = "json"  # the tensor holding the tree's JSON (every other tensor name has a "/")
TENSOR, TUPLE, ITEMS = "__tensor__", "__tuple__", "__items__"


def _encode(v, path: list[str], tensors: dict[str, torch.Tensor], sharded: list[str]):
    """The JSON form of ``v``; its tensors (cpu copies, DTensors as their local shard) added to ``tensors``."""
    if isinstance(v, torch.Tensor):
        key = "/".join(path)
        if isinstance(v, DTensor):
            sharded.append(key)
            v = v.to_local()
        assert key not in tensors and "/" in key, key  # paths are unique; JSON's own name has no "/"
        tensors[key] = v.detach().to("cpu", copy=True).contiguous()  # a copy: no storage shared with another
        return {TENSOR: key}
    if isinstance(v, tuple):
        return {TUPLE: [_encode(x, path + [str(i)], tensors, sharded) for i, x in enumerate(v)]}
    if isinstance(v, list):
        return [_encode(x, path + [str(i)], tensors, sharded) for i, x in enumerate(v)]
    if isinstance(v, dict):
        if all(isinstance(k, str) for k in v):
            return {k: _encode(x, path + [k], tensors, sharded) for k, x in v.items()}
        return {ITEMS: [[k, _encode(x, path + [str(k)], tensors, sharded)] for k, x in v.items()]}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"{'/'.join(path)}: a {type(v).__name__} cannot be stored in a checkpoint tree")


def _decode(v, tensors: dict[str, torch.Tensor]):
    if isinstance(v, list):
        return [_decode(x, tensors) for x in v]
    if not isinstance(v, dict):
        return v
    if set(v) == {TENSOR}:
        return tensors[v[TENSOR]]  # KeyError: the tree names a tensor the file lacks
    if set(v) == {TUPLE}:
        return tuple(_decode(x, tensors) for x in v[TUPLE])
    if set(v) == {ITEMS}:
        return {k: _decode(x, tensors) for k, x in v[ITEMS]}
    return {k: _decode(x, tensors) for k, x in v.items()}


def write_tree(path: Path, tree: dict, meta: dict[str, str], sharded: tuple[str, ...] | list[str] = ()) -> None:
    """Write ``tree`` to ``path`` atomically (module docstring). ``meta``: extra string entries of the safetensors
    metadata (besides ``format`` and ``sharded``); ``sharded``: names of plain tensors of the tree that are local
    shards too (listed with the DTensors'). Raises TypeError for a leaf of another type."""
    tensors: dict[str, torch.Tensor] = {}
    sharded = list(sharded)
    text = json.dumps(_encode(tree, [], tensors, sharded))
    tensors[JSON] = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)  # shape: (bytes,)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={**meta, "format": FORMAT, "sharded": json.dumps(sharded)})


def read_raw(path: Path, tensors: bool = True) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors by name, :data:`JSON` included; {} without ``tensors``) of a file :func:`write_tree`
    wrote. Raises TrainingError naming ``path`` for anything else (a pickle, a truncated file, another format),
    FileNotFoundError for no file."""
    try:
        with safe_open(str(path), "pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or JSON not in f.keys():
                raise ValueError(f"no {FORMAT!r} format entry and {JSON!r} tensor")
            return meta, {k: f.get_tensor(k) for k in f.keys()} if tensors else {}
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 — whatever the bytes are, they are refused, never interpreted
        raise refused(path, e) from None


def read_meta(path: Path) -> dict[str, str]:
    """The metadata of a checkpoint file (its header only). Raises like :func:`read_raw`."""
    return read_raw(path, tensors=False)[0]


def decode_tree(path: Path, tensors: dict[str, torch.Tensor]):
    """The tree of :func:`read_raw`'s ``tensors`` (sharded ones possibly joined by the caller). Raises
    TrainingError naming ``path`` when the JSON is malformed or names a tensor that is missing."""
    try:
        return _decode(json.loads(bytes(tensors[JSON].numpy()).decode()), tensors)
    except Exception as e:  # noqa: BLE001
        raise refused(path, e) from None


def read_tree(path: Path) -> tuple[dict, dict[str, str]]:
    """(the tree, the metadata) of ``path``; sharded tensors are this file's local shards. Raises TrainingError
    naming ``path`` for a file that is not such a tree (module docstring)."""
    meta, tensors = read_raw(path)
    return decode_tree(path, tensors), meta


def refused(path: Path, why: Exception) -> TrainingError:
    """The error for ``path`` that could not be read as a tree, and ``why``."""
    return TrainingError(
        f"checkpoint {path} is not an eaglepipe checkpoint ({FORMAT}: safetensors + JSON) and was not loaded "
        f"({type(why).__name__}: {why}); checkpoints are read as data only, never unpickled. If this run's "
        f"checkpoints are yours, delete {Path(path).parent} to train from the start")
