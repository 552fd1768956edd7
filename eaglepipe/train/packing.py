"""Which samples train and which are held out, and how an epoch's samples are packed into rows.

A row holds whole samples, ``Σ lengths ≤ train.batch_tokens``, concatenated along T (B = 1): attention never
crosses a sample boundary because every token carries its sample's index in ``Batch.doc``
(eaglepipe/train/ttt.py). A sample is never cut: :func:`check_lengths` refuses a sample longer than a row
before anything is read. Everything here is deterministic in (seed, epoch) and reads token counts only.
"""

from __future__ import annotations

import hashlib
import math

import torch

from eaglepipe.data.features import FeatureSample, SampleRef
from eaglepipe.errors import EaglepipeError, TrainingError
from eaglepipe.params import TrainParams
from eaglepipe.train.ttt import Batch

PACK_GROUP = 1024  # samples sorted by length together in pack_by_length (a group keeps the epoch's shuffle)


def split_samples(samples: list, eval_fraction: float, seed: int):
    """(train, eval): the ceil(eval_fraction·n) samples with the smallest sha256(seed:id) are held out.

    ``samples``: anything with an ``id`` (SampleRef, FeatureSample); order is kept within each part. The split
    of a sample does not change when other samples are added.
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

    Returns rows of indices into ``lengths``. Raises ValueError for a sample longer than max_tokens
    (:func:`check_lengths` names it first).
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
    """Length-grouped packing: ``order`` cut into groups of ``group`` consecutive samples, each group sorted
    longest first (ties by index) and packed first-fit (a sample goes to the first open row of its group it fits
    in). Rows come out group by group.

    Sorting only inside groups keeps the epoch's shuffle; first-fit-decreasing leaves less of each row empty
    than :func:`pack` (see :func:`padding_fraction`). Raises ValueError like :func:`pack`.
    """
    rows: list[list[int]] = []
    for w in range(0, len(order), group):
        chunk = sorted(order[w : w + group], key=lambda i: (-lengths[i], i))
        open_rows: list[tuple[list[int], int]] = []  # (row, tokens)
        for i in chunk:
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
    """The rows of one epoch: a (seed, epoch) shuffle (``torch.randperm`` on a generator of its own, so the
    global RNG is not touched), then ``packing`` = "greedy" (:func:`pack`) or "length" (:func:`pack_by_length`,
    then the rows shuffled by the same generator so an epoch does not run longest to shortest)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    if packing == "greedy":
        return pack(lengths, order, max_tokens)
    rows = pack_by_length(lengths, order, max_tokens)
    return [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]


def steps_per_epoch(n_rows: int, world: int, grad_accum: int) -> int:
    """Optimizer steps an epoch of ``n_rows`` rows makes: each of ``world`` ranks takes every world-th row and
    steps every ``grad_accum`` of them; the remainder is dropped. Packing follows the shuffle, so the number of
    rows (and steps) may differ by one between epochs."""
    return (n_rows // world) // grad_accum


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


def total_steps(lengths: list[int], p: TrainParams, world: int) -> int:
    """Optimizer steps of the whole run (Σ over epochs of :func:`steps_per_epoch`): the schedule's length.

    Raises EaglepipeError when an epoch would make no step (too few rows for world × grad_accum).
    """
    per_epoch = [steps_per_epoch(len(epoch_rows(lengths, p.seed, e, p.batch_tokens, p.packing)), world, p.grad_accum)
                 for e in range(p.epochs)]
    if min(per_epoch) == 0:
        raise EaglepipeError(
            f"{len(lengths)} training samples packed in rows of ≤{p.batch_tokens} tokens cannot make one step of "
            f"{world} ranks × grad_accum {p.grad_accum} per epoch; lower train.batch_tokens or train.grad_accum")
    return sum(per_epoch)
