"""The data thread: packed rows of samples read from the feature store (or captured online) ahead of the step.

Host memory holds ~``prefetch`` + 1 batches whatever the dataset size: a worker thread opens its own
:class:`eaglepipe.data.features.FeatureSet` (memory-mapped shards), reads a row shard by shard, checks that
every sample's features are finite (:func:`first_non_finite`) and collates it
(:func:`eaglepipe.train.packing.collate`). With a tokens store (``extract.store: tokens``) it reads token ids
only and :class:`eaglepipe.train.online.OnlineCapture` computes the features on the training device.
"""

from __future__ import annotations

import queue
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eaglepipe.data.features import FeatureSample, FeatureSet, SampleRef, non_finite
from eaglepipe.errors import TrainingError
from eaglepipe.train.online import OnlineCapture
from eaglepipe.train.packing import collate
from eaglepipe.train.ttt import Batch

PREFETCH = 4  # batches read ahead by the feature worker thread


def first_non_finite(samples: list[FeatureSample]) -> tuple[int, dict] | None:
    """(position, :func:`eaglepipe.data.features.non_finite` of it) for the first sample whose ``aux`` or ``last``
    holds a NaN/inf, else None. The samples' float32 sums are reduced on their device and read back in one
    transfer: one host sync a packed row, not two a sample (online features live on the GPU, where each sync
    also waits for the training step queued before it). Only a sample whose sum is not finite is counted
    exactly (a finite tensor whose sum overflows is not flagged)."""
    where = [(i, getattr(s, name)) for i, s in enumerate(samples) for name in ("aux", "last")
             if getattr(s, name) is not None]
    if not where:
        return None
    sums = torch.stack([t.sum(dtype=torch.float32) for _, t in where])
    for i in sorted({i for (i, _), ok in zip(where, torch.isfinite(sums).tolist()) if not ok}):
        bad = non_finite(samples[i])
        if bad:
            return i, bad
    return None


class BatchStream:
    """Packed rows read lazily from the feature store by a worker thread, ``prefetch`` batches ahead.

    Iterating yields ``(refs, Batch)`` per row, in order; the worker opens its own :class:`FeatureSet`
    (memory-mapped shards, :data:`eaglepipe.data.features.MAX_OPEN` open, a row read shard by shard), checks every
    sample's features are finite and collates on the CPU (pinned when ``pin``), so host memory holds
    ~``prefetch`` + 1 batches whatever the dataset size. ``inv``: sample id → (T,) bool, the target's top-1 is
    in the draft vocabulary (``Batch.top_in_vocab``).
    ``capture`` (online, a tokens store): the worker reads token ids only and the row's features come from
    ``capture`` (on its device); a tokens store without one, or a features store with one, raises
    FeatureStoreError. ``side_stream`` (online on CUDA, ``train.capture_stream``): the worker captures on a CUDA
    stream of its own, so the target's forward for the next rows overlaps the training step on the GPU; the
    consumer's stream waits on an event recorded after each row, and the row's device tensors are marked used
    by that stream (``Tensor.record_stream``) so the caching allocator does not hand their memory back to the
    worker's stream while the step still reads them (PyTorch "CUDA semantics": streams, record_stream).
    A worker error (TrainingError for a non-finite sample naming it and its shard, FeatureStoreError for a
    damaged shard or a store of the other kind) is raised in the consuming thread.
    A compiled capture (``capture.compiled``, train.fast on CUDA) runs in the consuming thread instead, on its
    stream, with the worker reading token ids: dynamo is not thread-safe (a compile in the worker while the step
    runs compiled code raises "Detected that you are using FX to symbolically trace a dynamo-optimized
    function"). Its kernels are queued before the step's, the host does not wait.
    Leaving the loop early stops the worker.
    """

    def __init__(self, features_dir: Path, rows: list[list[SampleRef]], inv: dict | None = None,
                 prefetch: int = PREFETCH, pin: bool = False, capture: OnlineCapture | None = None,
                 side_stream: bool = False):
        self.features_dir, self.rows, self.inv, self.pin = Path(features_dir), rows, inv, pin
        self.capture = capture
        self.here = capture is not None and getattr(capture, "compiled", False)  # capture in the consuming thread
        self.side = (torch.cuda.Stream() if side_stream and capture is not None and not self.here
                     and torch.cuda.is_available() else None)
        self.q: queue.Queue = queue.Queue(maxsize=prefetch)
        self.stop = threading.Event()

    def _samples(self, fs: FeatureSet, row: list[SampleRef]) -> list[FeatureSample]:
        """The row's samples, read from the shards or (online) captured; TrainingError for non-finite ones."""
        if self.capture is not None:
            return self._captured(row, fs.tokens_many(row))
        samples = fs.read_many(row)  # shard by shard: each shard opened once a row
        return self._checked(row, samples, lambda ref: f"in {self.features_dir / ref.shard}")

    def _captured(self, row: list[SampleRef], tokens: list) -> list[FeatureSample]:
        """Online: the row's features from ``capture`` over its (input_ids, loss_mask) ``tokens``."""
        feats = self.capture([ids for ids, _ in tokens])
        samples = [FeatureSample(r.id, ids, mask, aux, last) for r, (ids, mask), (aux, last) in zip(row, tokens, feats)]
        return self._checked(row, samples, lambda ref: f"(of {self.features_dir / ref.shard}) computed online")

    def _checked(self, row: list[SampleRef], samples: list[FeatureSample], where) -> list[FeatureSample]:
        found = first_non_finite(samples)
        if found is not None:
            ref, bad = row[found[0]], found[1]
            raise TrainingError(
                f"sample {ref.id!r} {where(ref)}: {bad['non_finite']} non-finite values in {bad['tensor']}; "
                "nothing was trained on it. Re-run extract (it quarantines such samples)")
        return samples

    def _work(self) -> None:
        try:
            fs = FeatureSet(self.features_dir)
            if self.capture is None:
                fs.require_store("features", "reading features from shards (no online capture given)")
            else:
                fs.require_store("tokens", "an online capture (which would recompute stored features)")
            for row in self.rows:
                if self.here:  # token ids only; the consuming thread captures (class docstring)
                    if not self._put((row, fs.tokens_many(row), None)):
                        return
                    continue
                with torch.cuda.stream(self.side) if self.side is not None else nullcontext():
                    b = collate(self._samples(fs, row), self.inv)
                    ready = self.side.record_event() if self.side is not None else None
                if self.pin:  # online features are already on the device: only host tensors are pinned
                    b = Batch(**{k: v if v is None or v.is_cuda else v.pin_memory() for k, v in vars(b).items()})
                if not self._put((row, b, ready)):
                    return
            self._put(None)
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        worker = threading.Thread(target=self._work, daemon=True, name="eaglepipe-features")
        worker.start()
        try:
            while (item := self.q.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                row, b, ready = item
                if self.here:  # b: the row's token ids
                    b = collate(self._captured(row, b), self.inv)
                if ready is not None:  # captured on the worker's stream: order, and keep the memory (docstring)
                    here = torch.cuda.current_stream()
                    here.wait_event(ready)
                    for t in vars(b).values():
                        if t is not None and t.is_cuda:
                            t.record_stream(here)
                yield row, b
        finally:
            self.stop.set()
            worker.join()


@dataclass
class Samples:
    """The run's samples (from the manifest index, nothing read) and how rows of them are streamed."""

    features_dir: Path
    train: list[SampleRef]
    held: list[SampleRef]  # the held-out samples evaluated each epoch
    inv: dict[str, torch.Tensor]  # sample id → (T,) bool, the target's top-1 is in the draft vocabulary
    capture: OnlineCapture | None = None  # online (a tokens store): the frozen target computing the features
    pin: bool = False  # pin host batches (CUDA)
    side_stream: bool = False  # online capture on a CUDA stream of its own (train.capture_stream)
    lengths: list[int] = field(init=False)  # tokens of each train sample

    def __post_init__(self):
        self.lengths = [r.n_tokens for r in self.train]

    def stream(self, rows: list[list[SampleRef]]) -> BatchStream:
        """Rows of refs → (refs, Batch) per row, read ahead by a :class:`BatchStream`."""
        return BatchStream(self.features_dir, rows, self.inv, pin=self.pin, capture=self.capture,
                           side_stream=self.side_stream)
