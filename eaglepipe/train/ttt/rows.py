"""Which positions each unrolled step computes, and the padding that gives rows few distinct lengths.

Step j at t reads only step j−1 at t (its hidden state and diagonal key) and the step-0 keys, so steps ≥ 1 run
only where a later loss reads their chain (:func:`chain_rows`). torch.compile and CUDA graphs specialize on
shapes, so the fast path pads: the row to one length per run (:func:`pad_batch`, :func:`padded_length`), the
later steps' positions to one of ≤ BUCKETS lengths (:func:`flex_rows`, :func:`bucket_length`), and under a CUDA
graph step 0's scored positions too (:func:`static_rows`). Positions are (n,) int64, ascending; a padding entry
is T (a position no sample has), always at the end.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from eaglepipe.train.ttt.batch import Batch
from eaglepipe.train.ttt.masks import BLOCK, counted_trained

PAD_DOC = 1 << 30  # ``doc`` of the padding :func:`pad_batch` appends: no real sample's index, never counted
BUCKETS = 8  # the flex path's later-step query lengths: multiples of T/BUCKETS (:func:`flex_rows`)


def rows_at(x: torch.Tensor, have: torch.Tensor | None, want: torch.Tensor | None, dim: int = 2) -> torch.Tensor:
    """x, whose ``dim`` holds n rows at positions ``have`` ((n,) int64 ascending; None: 0..n-1) → its rows at
    ``want`` ⊆ have ((m,) ascending; None: x itself). Padding entries of want (past every position in have, as
    :func:`flex_rows` appends) take the last row; whatever they compute is never scored."""
    if want is None:
        return x
    i = want if have is None else torch.searchsorted(have, want)  # (m,) index into x's rows
    return x.index_select(dim, i.clamp(max=x.shape[dim] - 1))  # x with m rows on dim


def chain_rows(trained: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The positions each TTT step must compute, from each step's ``trained`` mask ((1, T) bool, B = 1).

    Step j ≥ 1 need not run where no step j' ≥ j trains: rows_j = {t : trained_j'[t] for some j' ≥ j}, (n_j,)
    int64, ascending, nested (rows_{j+1} ⊆ rows_j). Step 0 → None (all T: its keys are every later step's
    context). Prompt positions drop out of every later step."""
    need = torch.zeros_like(trained[0][0])  # (T,) bool
    rows: list[torch.Tensor | None] = [None] * len(trained)
    for j in range(len(trained) - 1, 0, -1):
        need = need | trained[j][0]
        rows[j] = need.nonzero().squeeze(1)  # (n_j,)
    return rows


def pad_to(x: torch.Tensor, T: int, fill) -> torch.Tensor:
    """(B, t, ...) → (B, T, ...) with ``fill`` after position t (dim 1)."""
    return x if x.shape[1] == T else torch.cat([x, x.new_full((x.shape[0], T - x.shape[1], *x.shape[2:]), fill)], 1)


def padded_length(max_tokens: int) -> int:
    """The one row length of the fast path on CUDA: ``train.batch_tokens`` rounded up to BLOCK."""
    return -(-max_tokens // BLOCK) * BLOCK


def pad_batch(batch: Batch, T: int) -> Batch:
    """``batch`` (B, t) → (B, T) with a padding sample appended (doc PAD_DOC, loss_mask False, zero ids,
    positions and features; top_in_vocab False), so every row of a run has one shape and torch.compile and
    flex_attention compile once (rows of varying length would recompile the draft layer past dynamo's recompile
    limit, after which it runs eager, flex_attention unfused). The padding is never counted: no position of it
    has loss_mask, and no real position's successor lies in it (doc differs). Raises ValueError when t > T."""
    t = batch.input_ids.shape[1]
    if t > T:
        raise ValueError(f"pad_batch: row of {t} tokens is longer than {T}")
    if t == T:
        return batch
    return Batch(
        input_ids=pad_to(batch.input_ids, T, 0), positions=pad_to(batch.positions, T, 0),
        doc=pad_to(batch.doc, T, PAD_DOC), loss_mask=pad_to(batch.loss_mask, T, False),
        aux=pad_to(batch.aux, T, 0.0), last=pad_to(batch.last, T, 0.0),
        top_in_vocab=None if batch.top_in_vocab is None else pad_to(batch.top_in_vocab, T, False))


def flex_rows(rows: list[torch.Tensor | None], T: int) -> list[torch.Tensor | None]:
    """:func:`chain_rows` for :class:`~.attention.FlexTTTAttention` over a row of T positions (T % BLOCK == 0):
    every later step's (n_j,) padded with T to one length N = n_1 (the largest: rows are nested) rounded up to a
    multiple of T/BUCKETS in BLOCKs (at least one such multiple, at most T).

    Why buckets and not the exact n_j: torch.compile specializes on shapes, so exact counts would compile the
    draft layer anew for almost every row (past the recompile limit it runs eager, flex unfused). With one N per
    row for all later steps and N one of ≤ BUCKETS sizes, the graphs are one per (step, N, grad mode):
    ≤ 1 + BUCKETS·(steps−1) per grad mode, and rows carrying a similar share of assistant text meet few Ns. The
    price: up to T/BUCKETS padded queries per later step (their keys are seen by padding only, their outputs are
    never scored)."""
    if len(rows) < 2:
        return rows
    N = bucket_length(rows[1].numel(), T)
    return [None] + [_pad_rows(r, N, T) for r in rows[1:]]


def _pad_rows(r: torch.Tensor, N: int, T: int) -> torch.Tensor:
    """(n,) positions → (N,), padding entries T appended (a position no sample has)."""
    return torch.cat([r, r.new_full((N - r.numel(),), T)])  # (N,)


def bucket_length(n: int, T: int) -> int:
    """n rows of a row of T positions → the padded length :func:`flex_rows` gives them: n rounded up to a multiple
    of T/BUCKETS in BLOCKs (at least one such multiple, at most T)."""
    g = BLOCK * -(-T // (BLOCK * BUCKETS))  # bucket width, a multiple of BLOCK, ≤ T
    return min(T, max(g, -(-n // g) * g))


def static_rows(batch: Batch, top_in_vocab: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The rows of a one-row batch (B = 1, T positions) that :func:`~.unroll.ttt_unroll_fast` given ``rows``
    computes without waiting for the device: [step 0's scored positions (its ``trained`` ones), then
    :func:`flex_rows`' later steps], each (N_i,) int64 ascending, padded with T to :func:`bucket_length` (step 0's
    length and the later steps' one length are each one of ≤ BUCKETS sizes, so a CUDA graph per pair covers a
    run). Computed here, before a graph's replay: it reads the masks back from the device (``nonzero``).
    top_in_vocab: (1, T) bool, the soft targets' (what :func:`counted_trained` reads of them). Raises ValueError
    when B != 1."""
    if batch.input_ids.shape[0] != 1:
        raise ValueError(f"static_rows: one packed row (B = 1), got B = {batch.input_ids.shape[0]}")
    T = batch.input_ids.shape[1]
    soft = SimpleNamespace(top_in_vocab=top_in_vocab)
    trained = [counted_trained(batch, soft, j)[1] for j in range(steps)]  # (1, T) bool each
    r0 = trained[0][0].nonzero().squeeze(1)  # (n_0,)
    return [_pad_rows(r0, bucket_length(r0.numel(), T), T), *flex_rows(chain_rows(trained), T)[1:]]
