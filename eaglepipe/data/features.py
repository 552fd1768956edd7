"""The feature store: sharded safetensors + ``manifest.json``, written atomically, resumable, re-checked on read.

This is the hand-off between ``extract`` (writer) and ``validate_offsets`` / ``train_drafter`` (readers).

Shard ``shard-{i:05d}.safetensors`` holds S samples concatenated on one token axis (T = Σ tokens):

=============  ==========  =========================================================================
tensor         dtype       shape / meaning
=============  ==========  =========================================================================
``input_ids``  int64       (T,)       the token ids the target read (exactly these are trained on)
``loss_mask``  bool        (T,)       1 where the *next* token (the one predicted at t) is assistant text
``aux``        store dtype (T, L, H)  h[k] for k in ``layers`` (ascending boundary indices)
``last``       store dtype (T, H)     h[N], the last layer's output BEFORE the final norm
``offsets``    int64       (S + 1,)   sample s spans tokens ``offsets[s]:offsets[s+1]``
=============  ==========  =========================================================================

Safetensors metadata of each shard: ``sample_ids``, ``token_hashes``, ``loss_tokens``, ``quarantined`` (JSON
lists) and ``run_key`` (hash of everything that determines the features). ``manifest.json`` records the
engine, its version, the target, layers, dtype, one row per shard (file, samples, tokens, bytes), one row per
sample (id, shard, token count, loss-token count, token hash; a thinking-mode sample's ``kind`` from the shard's
``kinds`` metadata), the quarantined samples and totals.

Byte-reproducible: shards are serialised by :func:`save_shard` (tensors and metadata keys sorted, no
process-dependent order: safetensors' own ``save_file`` writes ``__metadata__`` in hash-map order, which
differs between processes), and the manifest is plain sorted-insertion JSON, so two extracts of the same
inputs give byte-identical files and DVC reruns nothing downstream.

Two stores (``manifest["store"]``, from ``extract.store``): ``features`` (above, every sample) and ``tokens``,
for online training: shards hold ``input_ids``, ``loss_mask`` and ``offsets`` of every sample, and ``aux`` /
``last`` only for the first samples of the dataset (the *gate samples*, ``validate.samples`` of them, which
validate_offsets compares against the serving engine): in each shard they are a prefix of its samples, so their
token ranges index ``aux`` / ``last`` exactly as in a features shard. A tokens shard's metadata adds
``messages`` (the regenerated conversations, JSON, so regeneration is never redone) and ``features`` (how many
leading samples carry features); the manifest's sample rows add ``features`` (bool) and its header
``gate_samples`` and ``engine_dtype`` (what the online capture needs to compute what extract would have stored).
Reading the features of a sample that has none raises :class:`FeatureStoreError` saying the store is ``tokens``.

Quarantine: a sample whose features hold NaN/inf never enters a shard; it is recorded (id, tensor, count of
non-finite values) in the shard's ``quarantined`` metadata and in the manifest (``quarantined``,
``totals.quarantined``). A shard all of whose samples were quarantined is not listed.

Reading is lazy (:class:`FeatureSet`): the manifest indexes every sample (shard, token range); a sample is
read with ``safe_open(...).get_slice`` from a memory-mapped shard (its token ids and masks from the shard's
whole arrays, read once while it is open), and at most ``max_open`` shards are open at once (:data:`MAX_OPEN`
by store), so host memory does not grow with the dataset. A shard whose size differs from the manifest's, or
that safetensors cannot parse, raises :class:`FeatureStoreError` naming the file.

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
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from eaglepipe.atomic import atomic_write_json
from eaglepipe.data.shard_file import save_shard
from eaglepipe.errors import CaptureMismatch, FeatureStoreError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# Shards a FeatureSet keeps open, by store: a features shard maps its features (GBs at 8B shapes), a tokens
# shard holds ~4 MB (1,024 samples' token ids, masks and text), and online rows mix samples of every shard
# (benchmarks/token_reads.py: 25.6 ms a row with 2 open, against ~80 ms reading in row order).
MAX_OPEN = {"features": 2, "tokens": 16}
STORE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def token_hash(input_ids: list[int] | torch.Tensor) -> str:
    """sha256 (first 16 hex digits) of the token ids as little-endian int64 bytes."""
    t = torch.as_tensor(input_ids, dtype=torch.int64).contiguous()
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def run_key(spec: dict) -> str:
    """A stable hash (16 hex digits) of a JSON-serialisable dict: keys the scratch folder of a run."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class FeatureSample:
    """One captured sequence.

    Attributes:
        id: the conversation id from the prompts stage.
        input_ids: int64 (T,).
        loss_mask: bool (T,); loss_mask[t] = 1 iff token t+1 lies in an assistant turn.
        aux: (T, L, H) aux hidden states h[k], k in ``layers`` ascending (store dtype).
        last: (T, H) h[N], pre-norm (store dtype).
        kind: a thinking-mode sample's mode and token counts (eaglepipe/data/extract.py ``_kind``), else None.
    """

    id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor
    kind: dict | None = None


def store_capture(h: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's capture of ``layers + [N]`` (T, L+1, H) float32 → (aux (T, L, H), last (T, H)) in the store
    dtype: the one cast extract stores and online training (eaglepipe/train/online.py) trains on."""
    store = STORE_DTYPES[dtype]
    return h[:, :-1].to(store), h[:, -1].to(store)


def _shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def non_finite(sample: "FeatureSample") -> dict | None:
    """None when ``aux`` and ``last`` are all finite; else ``{"id", "tensor", "non_finite"}`` (first bad tensor)."""
    for name in ("aux", "last"):
        t = getattr(sample, name)
        if t is None:  # a tokens store's sample without stored features
            continue
        if torch.isfinite(t.sum(dtype=torch.float32)):  # fast path (~20x cheaper than isfinite): any NaN/inf
            continue  # makes the sum non-finite; a finite sum means every element is finite
        bad = int((~torch.isfinite(t)).sum())  # exact count; 0 when only the sum overflowed
        if bad:
            return {"id": sample.id, "tensor": name, "non_finite": bad}
    return None


class ShardWriter:
    """Writes samples into shards of ``shard_size`` samples; resumable by ``key``. Processes sharing the scratch
    folder (extract's ranks) may each write their own shards of one key; one of them then calls :meth:`finish`.

    Usage: ``w = ShardWriter(out_dir, scratch_root, key, shard_size)``; ``w.write(i, [FeatureSample, ...])`` for
    each shard i that is not ``w.done(i)``; ``w.finish(manifest_header, n_shards)``.
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
        """True when shard i was finished by this or an earlier (killed) run with the same key. A killed writer
        leaves at most ``<shard>.tmp``; a shard file safetensors cannot parse (a crashed host's) is redone."""
        path = self.scratch / _shard_name(i)
        if not path.exists():
            return False
        try:
            with safe_open(path, "pt") as f:
                return (f.metadata() or {}).get("run_key") == self.key
        except SafetensorError as e:
            log.warning("%s is damaged (%s); extracting it again", path, e)
            return False

    def write(self, i: int, samples: list[FeatureSample], quarantined: list[dict] | None = None,
              messages: list | None = None) -> None:
        """Concatenate ``samples`` on the token axis and write shard i atomically and byte-reproducibly.

        quarantined: rows ``{"id", "tensor", "non_finite"}`` of samples of this shard left out (see
        :func:`non_finite`); kept in the shard's metadata so a resumed run still counts them.
        messages: a tokens store's shard (module docstring): each sample's conversation; samples whose ``aux``
        is None carry no features and must follow those that do.
        """
        lengths = [len(s.input_ids) for s in samples]
        offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)  # (S + 1,)
        with_features = [s for s in samples if s.aux is not None]
        assert all(s.aux is not None for s in samples[: len(with_features)]), "samples with features come first"
        tensors = {"offsets": offsets}
        if samples:
            tensors.update({
                "input_ids": torch.cat([s.input_ids.to(torch.int64) for s in samples]),  # (T,)
                "loss_mask": torch.cat([s.loss_mask.to(torch.bool) for s in samples]),  # (T,)
            })
        if with_features:
            tensors.update({
                "aux": torch.cat([s.aux for s in with_features]),  # (T_f, L, H), T_f = tokens of with_features
                "last": torch.cat([s.last for s in with_features]),  # (T_f, H)
            })
        meta = {
            "run_key": self.key,
            "sample_ids": json.dumps([s.id for s in samples]),
            "token_hashes": json.dumps([token_hash(s.input_ids) for s in samples]),
            "loss_tokens": json.dumps([int(s.loss_mask.sum()) for s in samples]),
            "quarantined": json.dumps(quarantined or [], sort_keys=True),
        }
        if any(s.kind is not None for s in samples):
            meta["kinds"] = json.dumps([s.kind for s in samples], sort_keys=True)
        if messages is not None:  # a tokens store's shard
            meta["messages"] = json.dumps(messages, sort_keys=True, ensure_ascii=False)
            meta["features"] = str(len(with_features))
        save_shard(tensors, self.scratch / _shard_name(i), meta)

    def finish(self, header: dict, n_shards: int) -> dict:
        """Move shards 0..n_shards-1 into ``out_dir``, write ``manifest.json`` (last), drop the scratch folder.

        Returns the manifest dict.
        """
        self.out_dir.mkdir(parents=True, exist_ok=True)
        samples, shards, quarantined = [], [], []
        for i in range(n_shards):
            name = _shard_name(i)
            with safe_open(self.scratch / name, "pt") as f:
                meta = f.metadata()
                offsets = f.get_tensor("offsets")
            ids, hashes = json.loads(meta["sample_ids"]), json.loads(meta["token_hashes"])
            loss = json.loads(meta["loss_tokens"])
            quarantined += [dict(q, shard=i) for q in json.loads(meta.get("quarantined", "[]"))]
            n_features = int(meta["features"]) if "features" in meta else None  # tokens store only
            kinds = json.loads(meta.get("kinds", "null")) or [None] * len(ids)
            for j, sid in enumerate(ids):
                n = int(offsets[j + 1] - offsets[j])
                samples.append({"id": sid, "shard": name, "n_tokens": n, "n_loss": loss[j], "token_hash": hashes[j],
                                **(kinds[j] or {})})
                if n_features is not None:
                    samples[-1]["features"] = j < n_features
            if not ids:  # every sample of this shard was quarantined
                os.remove(self.scratch / name)
                continue
            shards.append({"file": name, "samples": len(ids), "tokens": int(offsets[-1]),
                           "bytes": (self.scratch / name).stat().st_size})
            os.replace(self.scratch / name, self.out_dir / name)
        manifest = dict(header)
        manifest["run_key"] = self.key
        manifest["shards"] = shards
        manifest["samples"] = samples
        manifest["quarantined"] = quarantined
        manifest["totals"] = {
            "samples": len(samples),
            "tokens": sum(s["n_tokens"] for s in samples),
            "loss_tokens": sum(s["n_loss"] for s in samples),
            "quarantined": len(quarantined),
        }
        atomic_write_json(self.out_dir / MANIFEST, manifest)
        shutil.rmtree(self.scratch, ignore_errors=True)
        return manifest


@dataclass(frozen=True)
class SampleRef:
    """Where one stored sample lies: tokens ``start:stop`` of ``shard`` (a file name in the store)."""

    id: str
    shard: str
    start: int
    stop: int
    n_loss: int
    token_hash: str
    features: bool = True  # its aux / last are stored (always in a features store; gate samples in a tokens one)

    @property
    def n_tokens(self) -> int:
        return self.stop - self.start


class FeatureSet:
    """Read side of the store: ``FeatureSet(dir)`` reads the manifest; iterate (or :meth:`read` a
    :class:`SampleRef`) to get :class:`FeatureSample`. Nothing but the manifest is held in memory.

    Attributes:
        manifest: the parsed manifest.json.
        layers: list[int], the boundary indices of ``aux`` (ascending).
        n_layers: N of the target.
        store: "features" | "tokens" (module docstring); a manifest from before the key is a features store.
        refs: list[SampleRef], every sample in manifest order.

    Every sample read is re-checked against the manifest's token hash (raises :class:`CaptureMismatch`);
    a missing, truncated or unparsable shard raises :class:`FeatureStoreError` naming the file.
    Not thread-safe: use one FeatureSet per thread.
    """

    def __init__(self, path: str | Path, max_open: int | None = None):
        self.path = Path(path)
        try:
            self.manifest = json.loads((self.path / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise FeatureStoreError(f"features {self.path}: cannot read {MANIFEST} ({e}); re-run extract") from e
        self.layers: list[int] = list(self.manifest["layers"])
        self.n_layers: int = int(self.manifest["target"]["n_layers"])
        self.store: str = self.manifest.get("store", "features")
        self.max_open = max_open or MAX_OPEN[self.store]
        self._open: OrderedDict[str, object] = OrderedDict()
        self._tokens: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # open shards' whole input_ids, loss_mask
        self._bytes = {s["file"]: s.get("bytes") for s in self.manifest["shards"]}
        self.refs: list[SampleRef] = []
        pos: dict[str, int] = {}
        for sample in self.manifest["samples"]:
            start = pos.get(sample["shard"], 0)
            pos[sample["shard"]] = start + sample["n_tokens"]
            self.refs.append(SampleRef(sample["id"], sample["shard"], start, start + sample["n_tokens"],
                                       sample["n_loss"], sample["token_hash"], sample.get("features", True)))

    def __len__(self) -> int:
        return len(self.refs)

    def require_layers(self, layers: list[int]) -> None:
        """Refuse features stored for other boundaries than ``params.yaml: layers`` (CaptureMismatch): the stage
        that reads them (validate_offsets, train_drafter) would check or train the wrong layers."""
        if self.layers != list(layers):
            raise CaptureMismatch(f"features {self.path} hold layers {self.layers} but params.yaml says "
                                  f"{list(layers)}; re-run extract")

    def require_store(self, store: str, why: str) -> None:
        """Refuse a use meant for the other store (FeatureStoreError naming both and ``why``)."""
        if self.store != store:
            raise FeatureStoreError(f"features {self.path} are a {self.store!r} store (extract.store: {self.store}) "
                                    f"but {why} needs a {store!r} store; re-run extract with extract.store: {store}")

    def shard(self, name: str):
        """The open ``safe_open`` handle of shard ``name`` (at most ``max_open`` stay open, least recent closed)."""
        if name in self._open:
            self._open.move_to_end(name)
            return self._open[name]
        path = self.path / name
        want = self._bytes.get(name)
        got = path.stat().st_size if path.is_file() else None
        if got is None or (want is not None and got != want):
            raise FeatureStoreError(
                f"feature shard {path}: {'missing' if got is None else f'{got} bytes'}, manifest says {want} bytes "
                "(truncated or replaced); re-run extract")
        try:
            f = safe_open(path, "pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise FeatureStoreError(f"feature shard {path} is damaged ({e}); re-run extract") from e
        self._open[name] = f
        while len(self._open) > self.max_open:
            self._tokens.pop(self._open.popitem(last=False)[0], None)
        return f

    def _shard_tokens(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Shard ``name``'s whole input_ids (int64) and loss_mask (bool), read once while it is open (9 bytes a
        token: a sample's are then views, not a ``get_slice`` each, which parses nothing but costs ~0.1 ms)."""
        f = self.shard(name)
        if name not in self._tokens:
            try:
                self._tokens[name] = (f.get_tensor("input_ids"), f.get_tensor("loss_mask"))
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise FeatureStoreError(f"feature shard {self.path / name}: cannot read its token ids ({e}); "
                                        "re-run extract") from e
        return self._tokens[name]

    def _slice(self, ref: SampleRef, name: str) -> torch.Tensor:
        try:
            return self.shard(ref.shard).get_slice(name)[ref.start : ref.stop]
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise FeatureStoreError(
                f"feature shard {self.path / ref.shard}: cannot read {name!r} of sample {ref.id!r} ({e}); "
                "re-run extract") from e

    def tokens(self, ref: SampleRef) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids int64 (T,), loss_mask bool (T,)) of one sample, token hash checked; features not read."""
        all_ids, all_mask = self._shard_tokens(ref.shard)
        ids = all_ids[ref.start : ref.stop]
        got = token_hash(ids)
        if got != ref.token_hash:
            raise CaptureMismatch(
                f"sample {ref.id!r} in {ref.shard}: token hash {got} != manifest {ref.token_hash}; "
                "the features no longer belong to the token ids that were captured — re-run extract"
            )
        return ids, all_mask[ref.start : ref.stop]

    def tokens_many(self, refs: list[SampleRef]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`tokens` of each of ``refs``, in their order, read shard by shard: a packed row mixes samples of
        many shards, and read in row order with ``max_open`` shards open nearly every sample would reopen one
        (parsing its header, a tokens store's conversations included, again; benchmarks/token_reads.py)."""
        return self._in_shard_order(refs, self.tokens)

    def read_many(self, refs: list[SampleRef]) -> list[FeatureSample]:
        """:meth:`read` of each of ``refs``, in their order, read shard by shard (see :meth:`tokens_many`)."""
        return self._in_shard_order(refs, self.read)

    @staticmethod
    def _in_shard_order(refs: list[SampleRef], read) -> list:
        out = [None] * len(refs)
        for i in sorted(range(len(refs)), key=lambda i: (refs[i].shard, refs[i].start)):
            out[i] = read(refs[i])
        return out

    def read(self, ref: SampleRef) -> FeatureSample:
        """One sample (aux (T, L, H), last (T, H) in the store dtype), token hash checked. In a tokens store only
        the gate samples have features (FeatureStoreError for the others)."""
        if not ref.features:
            raise FeatureStoreError(
                f"sample {ref.id!r} in {self.path / ref.shard} has no stored features: {self.path} is a 'tokens' store "
                f"(extract.store: tokens), holding features only for its {self.n_gate} gate samples; train_drafter "
                "computes the others online (eaglepipe/train/online.py)")
        ids, mask = self.tokens(ref)
        return FeatureSample(ref.id, ids, mask, self._slice(ref, "aux"), self._slice(ref, "last"))

    @property
    def n_gate(self) -> int:
        """Samples whose features are stored (all of them in a features store)."""
        return sum(r.features for r in self.refs)

    def aux_shape(self) -> list[int]:
        """[T, L, H] of the first shard holding ``aux`` (header only); [] when none does."""
        ref = next((r for r in self.refs if r.features), None)
        return list(self.shard(ref.shard).get_slice("aux").get_shape()) if ref else []

    def __iter__(self):
        for ref in self.refs:
            yield self.read(ref)

    def take(self, n: int) -> list[FeatureSample]:
        """The first ``n`` samples in manifest order (in a tokens store: its gate samples, which are the first
        ones; FeatureStoreError when ``n`` asks for more than it holds while more samples exist)."""
        refs = self.refs[:n]
        if not all(r.features for r in refs):
            raise FeatureStoreError(
                f"features {self.path}: a 'tokens' store with features for {self.n_gate} gate samples, but {n} were "
                f"asked for (validate.samples); re-run extract (it stores validate.samples gate samples)")
        return [self.read(r) for r in refs]
