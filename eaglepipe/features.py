"""The feature store: sharded safetensors + ``manifest.json``, written atomically, resumable, re-checked on read.

This is the hand-off between ``extract`` (writer) and ``validate_offsets`` / ``train_drafter`` (readers).

Shard ``shard-{i:05d}.safetensors`` holds S samples concatenated on one token axis (T = Σ tokens):

=============  ==========  =========================================================================
tensor         dtype       shape / meaning
=============  ==========  =========================================================================
``input_ids``  int64       [T]        the token ids the target read (exactly these are trained on)
``loss_mask``  bool        [T]        1 where the *next* token (the one predicted at t) is assistant text
``aux``        store dtype [T, L, H]  h[k] for k in ``layers`` (ascending boundary indices)
``last``       store dtype [T, H]     h[N], the last layer's output BEFORE the final norm
``offsets``    int64       [S + 1]    sample s spans tokens ``offsets[s]:offsets[s+1]``
=============  ==========  =========================================================================

Safetensors metadata of each shard: ``sample_ids`` (JSON list) and ``run_key`` (hash of everything that
determines the features). ``manifest.json`` records the engine, its version, the target, layers, dtype and
one row per sample (id, shard, token count, loss-token count, token hash) and totals.

Atomicity and resume: every file is written to ``<name>.tmp`` and renamed. :class:`ShardWriter` writes into a
scratch folder keyed by ``run_key``; a killed run started again with the same key skips the shards already
there, so the result equals an uninterrupted run. Only :meth:`ShardWriter.finish` moves the shards into the
output folder (a DVC out, which DVC empties before each run) and writes the manifest last.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import CaptureMismatch

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def token_hash(input_ids: list[int] | torch.Tensor) -> str:
    """sha256 (first 16 hex digits) of the token ids as little-endian int64 bytes."""
    t = torch.as_tensor(input_ids, dtype=torch.int64).contiguous()
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def run_key(spec: dict) -> str:
    """A stable hash (16 hex digits) of a JSON-serialisable dict: keys the scratch folder of a run."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def atomic_write_json(path: Path, obj) -> None:
    """Write ``obj`` as indented JSON through ``path.tmp`` + rename."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


@dataclass
class FeatureSample:
    """One captured sequence.

    Attributes:
        id: the conversation id from the prompts stage.
        input_ids: int64 [T].
        loss_mask: bool [T]; loss_mask[t] = 1 iff token t+1 lies in an assistant turn.
        aux: [T, L, H] aux hidden states h[k], k in ``layers`` ascending (store dtype).
        last: [T, H] h[N], pre-norm (store dtype).
    """

    id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor


def _shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


class ShardWriter:
    """Writes samples into shards of ``shard_size`` samples; resumable by ``key``.

    Usage::

        w = ShardWriter(out_dir, scratch_root, key, shard_size)
        for i, chunk in enumerate(chunks):
            if w.done(i): continue
            w.write(i, [FeatureSample, ...])
        w.finish(manifest_header)
    """

    def __init__(self, out_dir: Path, scratch_root: Path, key: str, shard_size: int):
        self.out_dir = Path(out_dir)
        self.scratch = Path(scratch_root) / key
        self.key = key
        self.shard_size = shard_size
        for stale in self.scratch.parent.glob("*"):  # partial work of other params is never reused: drop it
            if stale.is_dir() and stale.name != key:
                log.info("removing stale partial extraction %s", stale)
                shutil.rmtree(stale, ignore_errors=True)
        self.scratch.mkdir(parents=True, exist_ok=True)

    def done(self, i: int) -> bool:
        """True when shard i was finished by this or an earlier (killed) run with the same key."""
        p = self.scratch / _shard_name(i)
        if not p.exists():
            return False
        with safe_open(p, "pt") as f:
            return (f.metadata() or {}).get("run_key") == self.key

    def write(self, i: int, samples: list[FeatureSample]) -> None:
        """Concatenate ``samples`` on the token axis and write shard i atomically."""
        lengths = [len(s.input_ids) for s in samples]
        offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        tensors = {
            "input_ids": torch.cat([s.input_ids.to(torch.int64) for s in samples]),
            "loss_mask": torch.cat([s.loss_mask.to(torch.bool) for s in samples]),
            "aux": torch.cat([s.aux for s in samples]).contiguous(),
            "last": torch.cat([s.last for s in samples]).contiguous(),
            "offsets": offsets,
        }
        meta = {
            "run_key": self.key,
            "sample_ids": json.dumps([s.id for s in samples]),
            "token_hashes": json.dumps([token_hash(s.input_ids) for s in samples]),
            "loss_tokens": json.dumps([int(s.loss_mask.sum()) for s in samples]),
        }
        tmp = self.scratch / (_shard_name(i) + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, self.scratch / _shard_name(i))

    def finish(self, header: dict, n_shards: int) -> dict:
        """Move shards 0..n_shards-1 into ``out_dir``, write ``manifest.json`` (last), drop the scratch folder.

        Returns the manifest dict.
        """
        self.out_dir.mkdir(parents=True, exist_ok=True)
        samples, shards = [], []
        for i in range(n_shards):
            name = _shard_name(i)
            with safe_open(self.scratch / name, "pt") as f:
                meta = f.metadata()
                offsets = f.get_tensor("offsets")
            ids, hashes = json.loads(meta["sample_ids"]), json.loads(meta["token_hashes"])
            loss = json.loads(meta["loss_tokens"])
            for j, sid in enumerate(ids):
                n = int(offsets[j + 1] - offsets[j])
                samples.append({"id": sid, "shard": name, "n_tokens": n, "n_loss": loss[j], "token_hash": hashes[j]})
            shards.append({"file": name, "samples": len(ids), "tokens": int(offsets[-1])})
            os.replace(self.scratch / name, self.out_dir / name)
        manifest = dict(header)
        manifest["run_key"] = self.key
        manifest["shards"] = shards
        manifest["samples"] = samples
        manifest["totals"] = {
            "samples": len(samples),
            "tokens": sum(s["n_tokens"] for s in samples),
            "loss_tokens": sum(s["n_loss"] for s in samples),
        }
        atomic_write_json(self.out_dir / MANIFEST, manifest)
        shutil.rmtree(self.scratch, ignore_errors=True)
        return manifest


class FeatureSet:
    """Read side of the store. ``FeatureSet(dir)`` reads the manifest; iterate to get :class:`FeatureSample`.

    Attributes:
        manifest: the parsed manifest.json.
        layers: list[int], the boundary indices of ``aux`` (ascending).
        n_layers: N of the target.

    Every sample read is re-checked against the manifest's token hash (raises :class:`CaptureMismatch`).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = json.loads((self.path / MANIFEST).read_text())
        self.layers: list[int] = list(self.manifest["layers"])
        self.n_layers: int = int(self.manifest["target"]["n_layers"])

    def __len__(self) -> int:
        return len(self.manifest["samples"])

    def __iter__(self):
        expected = {s["id"]: s["token_hash"] for s in self.manifest["samples"]}
        for shard in self.manifest["shards"]:
            with safe_open(self.path / shard["file"], "pt") as f:
                ids = json.loads(f.metadata()["sample_ids"])
                t = {k: f.get_tensor(k) for k in ("input_ids", "loss_mask", "aux", "last", "offsets")}
            off = t["offsets"]
            for j, sid in enumerate(ids):
                a, b = int(off[j]), int(off[j + 1])
                s = FeatureSample(sid, t["input_ids"][a:b], t["loss_mask"][a:b], t["aux"][a:b], t["last"][a:b])
                got = token_hash(s.input_ids)
                if got != expected.get(sid):
                    raise CaptureMismatch(
                        f"sample {sid!r} in {shard['file']}: token hash {got} != manifest {expected.get(sid)}; "
                        "the features no longer belong to the token ids that were captured — re-run extract"
                    )
                yield s

    def take(self, n: int) -> list[FeatureSample]:
        """The first ``n`` samples in manifest order."""
        out = []
        for s in self:
            if len(out) == n:
                break
            out.append(s)
        return out
