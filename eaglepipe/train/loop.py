"""The training loop of the draft: data split and packing, AdamW + warmup/cosine, TTT loss, DDP, checkpoints
with resume, per-epoch evaluation by τ_sim, dvclive curves, and the best draft written out.

Numbered steps (:func:`train_drafter` calls one named function per part):
 1. :func:`setup`: index the features from the manifest (nothing read yet); refuse a sample longer than
    ``batch_tokens`` (:func:`check_lengths`); the target's config / head / embeddings;
 2. split samples into train / eval by a hash of (seed, sample id) — stable when samples are added;
 3. draft vocabulary from the train split's predicted tokens (vocab.py; only token ids are read);
 4. build the draft (seeded), lm_head initialised from the target's lm_head rows of the draft vocabulary;
 5. :func:`resume` from ``<scratch>/<run key>/last.pt`` when a killed run with the same key left one;
 6. :func:`run_epoch`: shuffle (seed, epoch), pack by length into rows of ≤ batch_tokens
    (:func:`pack_by_length`), rank r takes micro-batches r::world, an optimizer step every grad_accum
    micro-batches (:func:`optimizer_step`); :func:`checkpoint` every checkpoint_every steps;
 7. :func:`end_epoch`: :func:`evaluate` the held-out samples, keep the weights with the best τ_sim (not the
    best loss);
 8. write the best draft (draft.save_draft) and return :func:`summarize`'s dict for the metrics json.

Data: features stream from the store (:class:`BatchStream`: a worker thread reads memory-mapped shard slices
and collates ``PREFETCH`` batches ahead), so host memory is bounded by a few batches, not the dataset. What
stays in memory for the whole run is the index (one :class:`SampleRef` per sample) and 1 byte per token
(whether the target's top-1 is in the draft vocabulary).

Online (a ``tokens`` store, ``extract.store: tokens``): the same rows, batches and loop, but the data thread
reads token ids and masks only and :class:`eaglepipe.train.online.OnlineCapture` (the frozen target on the training
device, extract's hf capture and cast) computes each row's aux states and h[N] before it is collated; what it
costs in device memory is in eaglepipe/train/online.py's docstring. A features store is read, never recomputed: the
store in the manifest decides, and :class:`BatchStream` refuses a capture that does not fit it.

Bad data never becomes a draft: a sample with non-finite features stops training naming it and its shard;
a non-finite loss or gradient norm stops before the optimizer step, naming the step's samples, with the
checkpoint of the last good step left in place (:class:`TrainingError`).

Precision: on CUDA the forward runs under bf16 autocast with fp32 master weights (the engines serve in bf16);
on CPU it runs in fp32 — CPU bf16 autocast is slower than fp32 on most CPUs without AMX and would make the
resume/DDP equality tests depend on kernel choice.

DDP: under torchrun (WORLD_SIZE > 1) each rank reads all samples and takes every world-th micro-batch; one
step of W ranks × accum a equals one process with accum W·a on the same micro-batches. Checkpoints are written
by rank 0; every rank resumes from it (nothing random is drawn during training, so rank 0's RNG state suffices).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import queue
import random
import shutil
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from eaglepipe.atomic import atomic_path
from eaglepipe.data.features import FeatureSample, FeatureSet, SampleRef, non_finite, run_key
from eaglepipe.errors import EaglepipeError, TrainingError
from eaglepipe.model.draft import DraftConfig, Eagle3Draft, n_params, save_draft
from eaglepipe.model.target_head import load_target_head, soft_targets
from eaglepipe.model.vocab import build_draft_vocab, count_predicted_tokens, vocab_stats
from eaglepipe.params import TrainParams
from eaglepipe.target.config import read_target_config
from eaglepipe.train.online import OnlineCapture
from eaglepipe.train.ttt import Batch, TTTResult, TTTUnroll, compile_draft, pad_batch, padded_length, tau_sim

log = logging.getLogger(__name__)

CKPT = "last.pt"
PACK_GROUP = 1024  # samples sorted by length together when packing (windows keep the shuffle on large sets;
# on the CPU defaults' 115 samples, windows of 64 left 1 row in 4 epochs of 6 half empty: 12 rows, not 11)
PREFETCH = 4  # batches read ahead by the feature worker thread


# ---------------------------------------------------------------- data


def split_samples(samples: list, eval_fraction: float, seed: int):
    """(train, eval): the ceil(eval_fraction·n) samples with the smallest sha256(seed:id) are held out.

    ``samples``: anything with an ``id`` (SampleRef, FeatureSample); order is kept within each part.
    """
    n_eval = min(len(samples) - 1, max(1, math.ceil(eval_fraction * len(samples))))
    key = {s.id: hashlib.sha256(f"{seed}:{s.id}".encode()).hexdigest() for s in samples}
    held = set(sorted(key, key=key.get)[:n_eval])
    return [s for s in samples if s.id not in held], [s for s in samples if s.id in held]


def check_lengths(refs: list[SampleRef], max_tokens: int) -> None:
    """Refuse a sample longer than a packed row: its tail would be cut and its loss tokens trained as nothing.

    Raises TrainingError naming the longest sample, its shard, its length and train.batch_tokens.
    """
    long = [r for r in refs if r.n_tokens > max_tokens]
    if long:
        worst = max(long, key=lambda r: r.n_tokens)
        raise TrainingError(
            f"sample {worst.id!r} in {worst.shard} has {worst.n_tokens} tokens but train.batch_tokens is {max_tokens} "
            f"({len(long)} of {len(refs)} samples are longer): they cannot be trained whole; raise "
            f"train.batch_tokens to ≥ {worst.n_tokens} or lower extract.max_length to ≤ {max_tokens}"
        )


def pack(lengths: list[int], order: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy packing in ``order``: consecutive samples share a row while the row stays ≤ max_tokens.

    Raises ValueError for a sample longer than max_tokens (:func:`check_lengths` names it first).
    """
    rows, cur, n = [], [], 0
    for i in order:
        if lengths[i] > max_tokens:
            raise ValueError(f"sample {i}: {lengths[i]} tokens > max_tokens {max_tokens}")
        if cur and n + lengths[i] > max_tokens:
            rows.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += lengths[i]
    if cur:
        rows.append(cur)
    return rows


def pack_by_length(lengths: list[int], order: list[int], max_tokens: int, group: int = PACK_GROUP) -> list[list[int]]:
    """Length-grouped packing: windows of ``group`` samples of ``order``, each sorted longest first and packed
    first-fit (a sample goes to the first open row of its window it fits in). Rows come out in window order.

    Sorting only inside windows keeps the epoch's shuffle; first-fit-decreasing leaves far less of each row
    empty than :func:`pack` (see :func:`padding_fraction`). Raises ValueError like :func:`pack`.
    """
    rows: list[list[int]] = []
    for w in range(0, len(order), group):
        window = sorted(order[w : w + group], key=lambda i: (-lengths[i], i))
        open_rows: list[tuple[list[int], int]] = []  # (row, tokens)
        for i in window:
            if lengths[i] > max_tokens:
                raise ValueError(f"sample {i}: {lengths[i]} tokens > max_tokens {max_tokens}")
            for k, (row, n) in enumerate(open_rows):
                if n + lengths[i] <= max_tokens:
                    row.append(i)
                    open_rows[k] = (row, n + lengths[i])
                    break
            else:
                open_rows.append(([i], lengths[i]))
        rows += [row for row, _ in open_rows]
    return rows


def padding_fraction(lengths: list[int], rows: list[list[int]], max_tokens: int) -> float:
    """Share of the rows' capacity (rows × max_tokens) holding no token: what a fixed-shape batch pads."""
    used = sum(lengths[i] for row in rows for i in row)
    return 1.0 - used / max(1, len(rows) * max_tokens)


def epoch_rows(lengths: list[int], seed: int, epoch: int, max_tokens: int, packing: str = "greedy") -> list[list[int]]:
    """The rows of one epoch: a (seed, epoch) shuffle, then ``packing`` = "greedy" (:func:`pack`, today's rows)
    or "length" (:func:`pack_by_length`, then the rows shuffled so an epoch does not run longest to shortest).

    Measured on the CPU defaults' features (115 train samples, 6 epochs): greedy 67 steps, padding 0.084, τ_sim
    1.1993 (evals and final loss equal to the pre-streaming loop's);
    length 66 steps, padding 0.071, τ_sim 1.1837 (13 held-out samples: within their noise, but lower)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    if packing == "greedy":
        return pack(lengths, order, max_tokens)
    rows = pack_by_length(lengths, order, max_tokens)
    return [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]


def collate(samples: list[FeatureSample], inv: dict[str, torch.Tensor] | None = None) -> Batch:
    """Samples → one packed row (B = 1), T = Σ lengths. ``inv``: sample id → (T_s,) bool top-1-in-vocab."""
    cat = lambda f: torch.cat([getattr(s, f) for s in samples])[None]  # noqa: E731  (1, T, ...)
    return Batch(
        top_in_vocab=None if inv is None else torch.cat([inv[s.id] for s in samples])[None],  # (1, T)
        input_ids=cat("input_ids").long(),  # (1, T)
        positions=torch.cat([torch.arange(len(s.input_ids)) for s in samples])[None],  # (1, T)
        doc=torch.cat([torch.full((len(s.input_ids),), d) for d, s in enumerate(samples)])[None],  # (1, T)
        loss_mask=cat("loss_mask").bool(),  # (1, T)
        aux=cat("aux"),  # (1, T, L, Ht)
        last=cat("last"),  # (1, T, H)
    )


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
    ~``prefetch`` + 1 batches whatever the dataset size.
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
    stream, with the worker reading token ids: dynamo is not thread-safe, and a (re)compile in the worker while
    the step runs its own compiled code failed on the H200 ("Detected that you are using FX to symbolically
    trace a dynamo-optimized function"). Its kernels are queued before the step's, the host does not wait.
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


@torch.no_grad()
def top1_in_vocab(head, features_dir: Path, refs: list[SampleRef], t2d: torch.Tensor, max_tokens: int,
                  capture: OnlineCapture | None = None) -> dict[str, torch.Tensor]:
    """sample id → (T,) bool: the target's full-vocabulary top-1 is in the draft vocabulary (one streamed pass
    over rows of ≤ ``max_tokens`` tokens, reused every epoch; 1 byte a token; online, one target forward a row,
    not one a sample). Raises like :class:`BatchStream`."""
    dev = head.lm_head.device
    out = {}
    rows = pack([r.n_tokens for r in refs], list(range(len(refs))), max_tokens)
    for row, b in BatchStream(features_dir, [[refs[i] for i in r] for r in rows], capture=capture):
        top = soft_targets(head, b.last.to(dev), t2d, need=b.loss_mask.to(dev)).top_in_vocab[0].cpu()  # (T,)
        for ref, t in zip(row, top.split(torch.bincount(b.doc[0].cpu(), minlength=len(row)).tolist())):
            out[ref.id] = t
    return out


# ---------------------------------------------------------------- schedule, distributed, checkpoints


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
    """Join the torchrun process group when WORLD_SIZE > 1 (nccl on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def pick_device(d: Dist) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(d.local_rank)
        return torch.device("cuda", d.local_rank)
    return torch.device("cpu")


def rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


# ---------------------------------------------------------------- the loop


@dataclass
class StepStats:
    """Sums over the micro-batches of one optimizer step (S = ttt_steps); this rank's until :meth:`reduce`."""

    step_loss: torch.Tensor  # (S,) float, Σ_micro loss_j / grad_accum
    correct: torch.Tensor  # (S,) float, counted positions where draft argmax == target argmax
    counted: torch.Tensor  # (S,) float, counted positions
    loss: torch.Tensor  # () float, Σ_micro weighted loss / grad_accum
    tokens: torch.Tensor  # () float, token positions processed

    @classmethod
    def zeros(cls, steps: int, device) -> "StepStats":
        z = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
        return cls(z(steps), z(steps), z(steps), z(()), z(()))

    def add(self, r: TTTResult, n_tokens: int, grad_accum: int) -> None:
        self.step_loss += r.step_loss / grad_accum
        self.correct += r.correct
        self.counted += r.counted
        self.loss += r.loss.detach() / grad_accum
        self.tokens += n_tokens

    def reduce(self, world: int) -> None:
        """All-reduce over ranks in one call: sums for counts/tokens, means for the losses."""
        if world == 1:
            return
        S = self.step_loss.numel()
        flat = torch.cat([self.step_loss, self.correct, self.counted, self.loss[None], self.tokens[None]])
        dist.all_reduce(flat)
        self.step_loss, self.correct, self.counted = flat[:S] / world, flat[S : 2 * S], flat[2 * S : 3 * S]
        self.loss, self.tokens = flat[3 * S] / world, flat[3 * S + 1]

    def curves(self, lr: float) -> dict[str, float]:
        """The dvclive row of this step: loss, lr, loss and accuracy per TTT step."""
        row = {"train/loss": float(self.loss), "train/lr": lr}
        acc = (self.correct / self.counted.clamp(min=1)).tolist()
        for j, (lj, aj) in enumerate(zip(self.step_loss.tolist(), acc)):
            row[f"train/loss_step{j}"], row[f"train/acc_step{j}"] = lj, aj
        return row


@dataclass
class State:
    """Everything a resumed run needs besides model / optimizer / scheduler."""

    epoch: int = 0  # current epoch
    micro: int = 0  # next micro-batch (this rank's list) within the epoch
    step: int = 0  # optimizer steps done
    tokens: int = 0  # token positions processed, all ranks
    seconds: float = 0.0  # training wall time so far
    best_tau: float = -1.0
    best_epoch: int = -1
    best_acc: list = field(default_factory=list)
    best_state: dict | None = None  # draft weights (cpu) of the best epoch
    evals: list = field(default_factory=list)  # one dict per epoch
    losses: list = field(default_factory=list)  # train loss per optimizer step (for tests and the json)
    padding: list = field(default_factory=list)  # padding fraction of each epoch's rows
    curves: list = field(default_factory=list)  # (step, {name: value}) every dvclive row so far, replayed on resume


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA, none on CPU (module docstring: Precision): the draft's compute in training and
    evaluation (and in benchmarks/sim_gap.py, which must evaluate as train does)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@dataclass
class Run:
    """What :func:`setup` builds once: data index, target head, draft, optimizer, schedule, checkpoint place."""

    d: Dist
    device: torch.device
    p: TrainParams
    features_dir: Path
    fs: FeatureSet
    train: list[SampleRef]
    held: list[SampleRef]
    lengths: list[int]  # tokens of each train sample
    inv: dict[str, torch.Tensor]  # sample id → (T,) bool, the target's top-1 is in the draft vocabulary
    head: object
    cfg: DraftConfig
    vstats: dict
    draft: Eagle3Draft
    unroll: TTTUnroll
    model: torch.nn.Module  # unroll, DDP-wrapped when world > 1
    opt: torch.optim.Optimizer
    sched: object
    total_steps: int
    ckpt: Path  # <scratch>/<run key>/last.pt
    target_dir: Path
    capture: OnlineCapture | None = None  # online (a tokens store): the frozen target computing the features

    def draft_extra(self) -> dict:
        """The draft's config.json entries besides its DraftConfig (what export and serve_eval read), before the
        best epoch's figures."""
        return {"layers": self.fs.layers, "target": str(self.target_dir)}

    def autocast(self):
        return autocast_for(self.device)

    def forward(self, b: Batch, module=None) -> TTTResult:
        """Soft targets and the TTT unroll of one batch (``module``: default the DDP-wrapped model)."""
        b = b.to(self.device)
        if self.p.fast and b.input_ids.is_cuda:  # one row shape: the compiled draft and flex compile once
            b = pad_batch(b, padded_length(self.p.batch_tokens))
        # train.teacher_precision applies to training steps; evaluation (module given) keeps the fp32 teacher
        precision = self.p.teacher_precision if module is None else "fp32"
        soft = soft_targets(self.head, b.last, self.draft.t2d, b.top_in_vocab, precision=precision, need=b.loss_mask)
        with self.autocast():
            return (module or self.model)(b, soft)

    def stream(self, rows: list[list[SampleRef]]) -> BatchStream:
        return BatchStream(self.features_dir, rows, self.inv, pin=self.device.type == "cuda", capture=self.capture,
                           side_stream=self.p.capture_stream and self.device.type == "cuda")


def _index(features_dir: Path, p: TrainParams, cfg_width: int) -> tuple[FeatureSet, list, list]:
    """Manifest index, split, and the checks that need no feature read. Raises EaglepipeError / TrainingError."""
    fs = FeatureSet(features_dir)
    width = fs.aux_shape()[-1] if fs.store == "features" and fs.refs else fs.manifest["target"]["hidden_size"]
    if fs.refs and width != cfg_width:
        raise EaglepipeError(
            f"features {features_dir}: aux width {width} != target hidden_size {cfg_width}; "
            "the features were captured from another target")
    if len(fs) < 2:
        raise EaglepipeError(f"features {features_dir}: {len(fs)} samples; need ≥ 2 (train + held-out)")
    check_lengths(fs.refs, p.batch_tokens)
    train, held = split_samples(fs.refs, p.eval_fraction, p.seed)
    return fs, train, held


def setup(features_dir, target_dir, p: TrainParams, d: Dist, device: torch.device, scratch_dir) -> Run:
    """Steps 1–4: index the features, split, draft vocabulary, draft, optimizer and schedule.

    Raises EaglepipeError (features of another target, < 2 samples, no full step per epoch), TrainingError
    (a sample longer than train.batch_tokens, non-finite features), FeatureStoreError (damaged shard).
    """
    features_dir = Path(features_dir)
    target_cfg = read_target_config(target_dir)
    head = load_target_head(target_dir)
    n_aux = len(FeatureSet(features_dir).layers)
    cfg = DraftConfig.from_target(target_cfg, n_aux=n_aux, draft_vocab_size=p.draft_vocab_size,
                                  intermediate_size=p.draft_intermediate_size)
    if cfg.n_aux != 3:  # both engines size fc from num_aux_hidden_states, which export writes (convention.py)
        log.info("%d aux layers: fc reads %d·Ht; export writes num_aux_hidden_states = %d, from which SGLang's and "
                 "vLLM's llama_eagle3.py size fc", cfg.n_aux, cfg.n_aux, cfg.n_aux)
    fs, train, held = _index(features_dir, p, cfg.target_hidden_size)
    counts = count_predicted_tokens((FeatureSample(r.id, *fs.tokens(r), None, None) for r in train), cfg.vocab_size)
    vocab = build_draft_vocab(counts, p.draft_vocab_size)
    vstats = vocab_stats(counts, vocab)
    log.info("samples: %d train / %d eval; draft vocab %d covers %.1f%% of predicted tokens",
             len(train), len(held), vocab.size, 100 * vstats["coverage"])
    torch.manual_seed(p.seed)
    draft = Eagle3Draft(cfg)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    with torch.no_grad():  # start from the target's lm_head rows (as speculators does). Also copying the target's
        # final norm weight was tried on SmolLM2 features: less stable (eval loss rose at lr 3e-3), so norm starts at 1
        draft.lm_head.weight.copy_(head.lm_head[vocab.t2d])  # (Vd, H)
    draft.to(device)
    head = head.to(device)
    capture = (OnlineCapture(target_dir, fs.manifest, device, 2 * p.batch_tokens,  # fast + compile_capture: compiled
                             compile=p.fast and p.compile_capture and device.type == "cuda") if fs.store == "tokens" else None)
    inv = top1_in_vocab(head, features_dir, fs.refs, draft.t2d, p.batch_tokens, capture)
    head = head.draft_rows(draft.t2d)  # from here on only the draft rows of lm_head are multiplied
    draft.lm_head.weight.requires_grad_(not p.freeze_lm_head)
    unroll = TTTUnroll(draft, head.embed, p.ttt_steps, p.step_decay, fast=p.fast).to(device)
    if p.fast:
        compile_draft(draft)
    ids = [device.index] if device.type == "cuda" else None
    model = DDP(unroll, device_ids=ids, broadcast_buffers=False) if d.world > 1 else unroll
    opt = torch.optim.AdamW([q for q in draft.parameters() if q.requires_grad], lr=p.lr, weight_decay=p.weight_decay,
                            betas=(0.9, 0.95), fused=p.fast and device.type == "cuda")
    lengths = [r.n_tokens for r in train]
    per_epoch = [_steps_per_epoch(epoch_rows(lengths, p.seed, e, p.batch_tokens, p.packing), d, p)
                 for e in range(p.epochs)]
    if min(per_epoch) == 0:
        raise EaglepipeError(
            f"{len(train)} training samples packed in rows of ≤{p.batch_tokens} tokens cannot make one step of "
            f"{d.world} ranks × grad_accum {p.grad_accum} per epoch; lower train.batch_tokens or train.grad_accum")
    total = sum(per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, p.warmup_steps, total))
    key = run_key({"train": p.model_dump(exclude={"capture_stream", "compile_capture"}),  # no result changes: resumable
                   "features": fs.manifest.get("run_key"), "n": len(fs), "target": target_cfg, "world": d.world})
    return Run(d, device, p, features_dir, fs, train, held, lengths, inv, head, cfg, vstats, draft, unroll, model,
               opt, sched, total, Path(scratch_dir) / key / CKPT, Path(target_dir), capture)


def _steps_per_epoch(rows: list, d: Dist, p: TrainParams) -> int:
    # packing depends on the shuffle, so the number of rows (and steps) may differ by one between epochs
    return (len(rows) // d.world) // p.grad_accum


def resume(run: Run) -> State:
    """Step 5: load ``run.ckpt`` when a killed run with the same key left one (model, optimizer, schedule, RNG,
    :class:`State`); else a fresh State. Rank 0 creates the checkpoint folder."""
    st = State()
    if run.ckpt.exists():
        ck = torch.load(run.ckpt, map_location="cpu", weights_only=False)
        run.draft.load_state_dict(ck["model"])
        run.opt.load_state_dict(ck["optimizer"])
        run.sched.load_state_dict(ck["scheduler"])
        set_rng_state(ck["rng"])
        st = State(**{**vars(State()), **vars(ck["state"])})  # a checkpoint from before a State field was added
        log.info("resumed %s at epoch %d, micro-batch %d, step %d", run.ckpt, st.epoch, st.micro, st.step)
    if run.d.main:
        run.ckpt.parent.mkdir(parents=True, exist_ok=True)
    return st


def checkpoint(run: Run, st: State) -> None:
    """Write ``run.ckpt`` atomically (rank 0); every rank waits for it."""
    if run.d.main:
        with atomic_path(run.ckpt) as tmp:
            torch.save({"model": run.draft.state_dict(), "optimizer": run.opt.state_dict(),
                        "scheduler": run.sched.state_dict(), "rng": rng_state(), "state": st,
                        "draft": {"config": run.cfg.to_dict(), "extra": run.draft_extra(), "epochs": run.p.epochs}},
                       tmp)
    if run.d.world > 1:
        dist.barrier()


class Curves:
    """dvclive curves whose history lives in the checkpoint: on resume the rows before the resume point are
    replayed from :attr:`State.curves` into a fresh dvclive folder, so the curves show every step from the
    start even when the folder was emptied in between (``dvc repro`` empties outs before a stage runs)."""

    def __init__(self, live_dir, st: State, main: bool):
        self.live, self.st = None, st
        if live_dir is None or not main:
            return
        try:
            from dvclive import Live
        except ImportError:  # e.g. the GPU image: curves are lost, metrics JSON still written
            log.warning("dvclive is not installed: no training curves in %s", live_dir)
            return
        self.live = Live(str(live_dir), resume=False, save_dvc_exp=False, dvcyaml=None, report=None)
        for step, row in st.curves:
            self._write(step, row)

    def _write(self, step: int, row: dict) -> None:
        self.live.step = step
        for k, v in row.items():
            self.live.log_metric(k, v)
        self.live.next_step()

    def log(self, step: int, row: dict) -> None:
        self.st.curves.append((step, row))
        if self.live is not None:
            self._write(step, row)

    def end(self, best_tau: float) -> None:
        if self.live is not None:
            self.live.log_metric("best/tau_sim", best_tau, plot=False)
            self.live.end()


def _raise_non_finite(run: Run, st: State, rows: list, loss: float, grad_norm: float) -> None:
    names = ", ".join(f"{r.id!r} ({r.shard})" for row in rows for r in row)
    kept = f"the last good checkpoint {run.ckpt} is kept" if run.ckpt.exists() else "no checkpoint was written yet"
    raise TrainingError(
        f"non-finite training loss {loss} (grad norm {grad_norm}) at optimizer step {st.step + 1}, epoch {st.epoch}, "
        f"rank {run.d.rank}; its micro-batches held samples {names} (their features are finite); nothing of this "
        f"step was applied and {kept}. Lower train.lr or check those samples")


def optimizer_step(run: Run, st: State, stats: StepStats, rows: list, curves: Curves) -> None:
    """Reduce the step's stats, refuse a non-finite loss or gradient, clip, step, schedule, log one curve row."""
    stats.reduce(run.d.world)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.draft.parameters(), run.p.grad_clip))
    loss = float(stats.loss)
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        _raise_non_finite(run, st, rows, loss, grad_norm)
    run.opt.step()
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    st.step += 1
    st.tokens += int(stats.tokens)
    st.losses.append(loss)
    curves.log(st.step, stats.curves(run.sched.get_last_lr()[0]))


def run_epoch(run: Run, st: State, curves: Curves, stop_after: int | None) -> bool:
    """Step 6: this rank's micro-batches of epoch ``st.epoch`` from ``st.micro`` on; True when stopped early."""
    p, d = run.p, run.d
    rows = epoch_rows(run.lengths, p.seed, st.epoch, p.batch_tokens, p.packing)
    if st.micro == 0:
        st.padding.append(padding_fraction(run.lengths, rows, p.batch_tokens))
    n_micro = _steps_per_epoch(rows, d, p) * p.grad_accum
    mine = [[run.train[i] for i in row] for row in rows[d.rank :: d.world][:n_micro]]
    t0, stats, step_rows = time.time(), StepStats.zeros(p.ttt_steps, run.device), []
    for refs, b in run.stream(mine[st.micro :]):
        last_micro = (st.micro + 1) % p.grad_accum == 0
        sync = run.model.no_sync() if (d.world > 1 and not last_micro) else nullcontext()
        with sync:
            r = run.forward(b)
            (r.loss / p.grad_accum).backward()
        stats.add(r, b.input_ids.numel(), p.grad_accum)
        step_rows.append(refs)
        st.micro += 1
        if not last_micro:
            continue
        optimizer_step(run, st, stats, step_rows, curves)
        stats, step_rows = StepStats.zeros(p.ttt_steps, run.device), []
        if st.step % p.checkpoint_every == 0 or st.step == stop_after:
            st.seconds, t0 = st.seconds + time.time() - t0, time.time()
            checkpoint(run, st)
        if st.step == stop_after:
            log.info("stopping after step %d (stop_after)", st.step)
            return True
    st.seconds += time.time() - t0
    return False


def evaluate(run: Run) -> dict:
    """Step 7: TTT on the held-out samples: per-step accuracy over counted positions, mean loss, τ_sim, OOV
    top-1 share, counted positions. Nothing is backpropagated; on CUDA with ``train.fast`` the unroll still runs
    with autograd on, because dynamo guards on the grad mode: so the training step's compiled graphs serve the
    evaluation instead of a second set compiled for no-grad (H200, 2026-12-04: the first eval took 62.4 s, the
    next 8.6 s). Elsewhere under no_grad."""
    rows = pack([r.n_tokens for r in run.held], list(range(len(run.held))), run.p.batch_tokens)
    batches = run.stream([[run.held[i] for i in row] for row in rows])
    with torch.set_grad_enabled(run.p.fast and run.device.type == "cuda"):
        return eval_summary((run.forward(b, run.unroll) for _, b in batches), run.p.ttt_steps)


def eval_summary(results, steps: int) -> dict:
    """Held-out TTTResults (one per packed row) → per-step accuracy over counted positions, mean loss, τ_sim,
    OOV top-1 share, counted positions (:func:`evaluate`; benchmarks/sim_gap.py on other samples)."""
    correct, counted, trained = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    loss, n = 0.0, 0
    for r in results:
        correct += r.correct.cpu()
        counted += r.counted.cpu()
        trained += r.trained.cpu()
        loss, n = loss + float(r.loss), n + 1
    acc = (correct / counted.clamp(min=1)).tolist()
    return {
        "loss": loss / max(n, 1),
        "acc": acc,
        "tau_sim": tau_sim(acc),
        "oov_top1": float(1 - trained[0] / counted[0].clamp(min=1)),
        "positions": int(counted[0]),
    }


def compile_stats() -> tuple[int, float]:
    """(graphs torch.compile has compiled, seconds spent compiling them) in this process so far, from dynamo's
    own counters (``torch._dynamo.utils``: ``counters["stats"]["unique_graphs"]``, the ``_compile.compile_inner``
    timings); both inside the epochs' training and eval seconds. (0, 0.0) when nothing was compiled. The H200 runs
    of 2026-12-04 trained epoch 0 at about half the speed of epoch 1 (45.5k against ~94k tok/s); this says how much
    of that is compiling (the fast path compiles up to 1 + BUCKETS·(steps−1) graphs per grad mode, ttt.flex_rows)."""
    from torch._dynamo.utils import compilation_time_metrics, counters
    return int(counters["stats"]["unique_graphs"]), float(sum(compilation_time_metrics.get("_compile.compile_inner",
                                                                                           [])))


def end_epoch(run: Run, st: State, curves: Curves) -> None:
    """Step 7: evaluate, log, keep the weights if τ_sim is the best so far, move to the next epoch, checkpoint."""
    t0 = time.time()
    ev = evaluate(run)
    ev["epoch"], ev["step"] = st.epoch, st.step
    st.evals.append(ev)
    graphs, compiling = compile_stats()
    log.info("epoch %d: eval loss %.4f, acc %s, tau_sim %.3f (training %.0f s so far, %.0f tok/s; eval %.1f s; "
             "%d graphs compiled in %.0f s so far)", st.epoch, ev["loss"], [round(a, 3) for a in ev["acc"]],
             ev["tau_sim"], st.seconds, st.tokens / st.seconds if st.seconds else 0.0, time.time() - t0, graphs,
             compiling)
    row = {"eval/tau_sim": ev["tau_sim"], "eval/loss": ev["loss"]}
    row.update({f"eval/acc_step{j}": a for j, a in enumerate(ev["acc"])})
    curves.log(st.step, row)
    if ev["tau_sim"] > st.best_tau:
        st.best_tau, st.best_epoch, st.best_acc = ev["tau_sim"], st.epoch, ev["acc"]
        st.best_state = {k: v.detach().cpu().clone() for k, v in run.draft.state_dict().items()}
    st.epoch, st.micro = st.epoch + 1, 0
    checkpoint(run, st)


def summarize(run: Run, st: State, resumed_from: int) -> dict:
    """Step 8's metrics dict (flat per-step accuracies for dvc)."""
    per_step = lambda acc: {f"step{j}": round(a, 4) for j, a in enumerate(acc)}  # noqa: E731
    return {
        "draft": run.cfg.to_dict(),
        "layers": run.fs.layers,
        "store": run.fs.store,  # tokens: features computed online (the target ran in the loop)
        "vocab": run.vstats,
        "samples": {"train": len(run.train), "eval": len(run.held)},
        "train_tokens": st.tokens,
        "steps": st.step,
        "seconds": round(st.seconds, 2),
        "tokens_per_s": round(st.tokens / st.seconds, 1) if st.seconds else 0.0,
        "padding_fraction": round(sum(st.padding) / max(1, len(st.padding)), 4),
        "best": {"epoch": st.best_epoch, "tau_sim": round(st.best_tau, 4), "acc": per_step(st.best_acc)},
        "oov_top1": round(st.evals[-1]["oov_top1"], 4),
        "evals": {f"epoch{e['epoch']}": {"tau_sim": round(e["tau_sim"], 4), "loss": round(e["loss"], 4),
                                         "acc": per_step(e["acc"])} for e in st.evals},
        "final_train_loss": st.losses[-1] if st.losses else None,
        "device": str(run.device),
        "world_size": run.d.world,
        "resumed_from_step": resumed_from,
    }


def save_best_so_far(scratch_dir: str | Path, out_dir: str | Path) -> dict:
    """The best epoch so far of a run that is still training, or was killed, written to ``out_dir`` as
    :func:`train_drafter` writes its draft (config.json + model.safetensors), with ``interim`` in config.json: the
    epochs ended, of how many, and the optimizer step. Reads the newest ``<scratch_dir>/<run key>/last.pt``
    (written atomically, so reading it beside a running training is safe). For a GPU window about to end
    (``suite.sh ckpt-keep``): the eighteenth window's budget ended in epoch 3 with epochs 1–2 evaluated, and
    nothing was kept. Returns {"epochs_ended", "epochs", "step", "best_epoch", "best_tau_sim"}.
    Raises EaglepipeError: no checkpoint under scratch_dir, or none with an ended epoch (nothing evaluated yet)."""
    ckpts = sorted(Path(scratch_dir).glob(f"*/{CKPT}"), key=lambda f: f.stat().st_mtime)
    if not ckpts:
        raise EaglepipeError(f"no training checkpoint under {scratch_dir} (train_drafter writes <run key>/{CKPT})")
    ck = torch.load(ckpts[-1], map_location="cpu", weights_only=False)
    st, meta = ck["state"], ck.get("draft")
    if meta is None or st.best_state is None:
        raise EaglepipeError(f"{ckpts[-1]}: no epoch has ended yet (or the checkpoint predates this function), so "
                             "no evaluated weights to keep; wait for the first epoch's eval line")
    draft = Eagle3Draft(DraftConfig(**meta["config"]))
    draft.load_state_dict(st.best_state)
    info = {"epochs_ended": st.epoch, "epochs": meta["epochs"], "step": st.step, "best_epoch": st.best_epoch,
            "best_tau_sim": st.best_tau}
    save_draft(draft, Path(out_dir), extra={**meta["extra"], "best_tau_sim": st.best_tau,
                                            "best_epoch": st.best_epoch, "interim": info})
    return info


def train_drafter(
    features_dir: str | Path,
    target_dir: str | Path,
    out_dir: str | Path,
    p: TrainParams,
    *,
    scratch_dir: str | Path,
    live_dir: str | Path | None = None,
    stop_after: int | None = None,
) -> dict:
    """Train, keep the best epoch by τ_sim, write ``out_dir`` (draft.save_draft), return the summary dict.

    scratch_dir: where ``<run key>/last.pt`` lives (outside DVC outs, so a killed run resumes).
    live_dir: dvclive folder (None: no dvclive).
    stop_after: stop (as if killed) right after the checkpoint of this optimizer step (tests).
    Raises TrainingError (non-finite features or loss: the checkpoint of the last good step is kept; a sample
    longer than train.batch_tokens), FeatureStoreError, CaptureMismatch, EaglepipeError (see :func:`setup`).
    """
    d = init_distributed()
    run = setup(features_dir, target_dir, p, d, pick_device(d), scratch_dir)
    st = resume(run)
    resumed_from = st.step
    curves = Curves(live_dir, st, d.main)
    log.info("draft: %d trainable parameters, %d optimizer steps, device %s, world %d",
             n_params(run.draft), run.total_steps, run.device, d.world)
    while st.epoch < p.epochs:
        if run_epoch(run, st, curves, stop_after):
            return {"stopped_at": st.step, "losses": st.losses}
        end_epoch(run, st, curves)
    summary = summarize(run, st, resumed_from)
    if d.main:
        run.draft.load_state_dict(st.best_state)
        save_draft(run.draft, Path(out_dir), extra={**run.draft_extra(), "best_tau_sim": st.best_tau,
                                                    "best_epoch": st.best_epoch})
        curves.end(st.best_tau)
        shutil.rmtree(run.ckpt.parent, ignore_errors=True)
    if d.world > 1:
        dist.barrier()
    summary["losses"] = st.losses
    return summary
