"""The masks of the unrolled steps: which positions step j counts in its loss, and which keys each query sees.

Loss masks (:func:`counted_trained`; the shift is :mod:`.unroll`'s table): step j at position t predicts
x_{t+2+j} ~ p_{t+1+j}; it is *counted* iff t+1+j is in t's sample and loss_mask[t+1+j] (x_{t+2+j} is assistant
text), and *trained* iff counted and the target's top-1 at t+1+j is in the draft vocabulary.

Attention: keys grow by one "layer" per step. A step-j query at t sees step-0 keys at positions ≤ t of its own
sample (the engine's KV cache after the extend pass: (g_s, x_{s+1}) for s ≤ t) and, for each later step
i = 1..j, only the key at t (its own chain's earlier drafted positions). T = 4, step 2 (rows = queries t,
columns = keys [step 0 | step 1 | step 2])::

    t=0  1 0 0 0 | 1 0 0 0 | 1 0 0 0
    t=1  1 1 0 0 | 0 1 0 0 | 0 1 0 0
    t=2  1 1 1 0 | 0 0 1 0 | 0 0 1 0
    t=3  1 1 1 1 | 0 0 0 1 | 0 0 0 1

This is what an engine computes, and what speculators and SpecForge 0.2.0 compute too (SpecForge in both its
attention backends; SafeAILab/EAGLE#247 discusses the original EAGLE-3 code). One difference from speculators is
kept: its step-j shift does not check sample boundaries in a packed row, so its last j positions of each sample
are scored against the next sample's tokens; here they are not counted.

Three forms of the attention mask: :func:`ttt_mask` (dense, for documentation and tests), :func:`step0_mask`
(the step-0 block that :class:`~.attention.TTTAttention` applies; later blocks are diagonals), and the
flex_attention pair :func:`ttt_mask_mod` / :func:`ttt_block_mask` (:class:`~.attention.FlexTTTAttention`).
"""

from __future__ import annotations

import torch

from eaglepipe.model.target_head import SoftTargets
from eaglepipe.train.ttt.batch import Batch

BLOCK = 128  # flex_attention's block size; the fast path pads the row to a multiple of it


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """y[:, t] = x[:, t+n], ``fill`` past the end (dim 1)."""
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)  # (B, n, ...)
    return torch.cat([x[:, n:], pad], dim=1)  # (B, T, ...)


def counted_trained(batch: Batch, soft: SoftTargets, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step j's ``counted`` and ``trained`` masks, (B, T) bool each (the module docstring's rule)."""
    n = 1 + j
    counted = (shift_left(batch.doc, n, -2) == batch.doc) & shift_left(batch.loss_mask, n, False)  # (B, T)
    return counted, counted & shift_left(soft.top_in_vocab, n, False)


def step0_mask(doc: torch.Tensor) -> torch.Tensor:
    """(B, T) sample ids → (B, 1, T, T) bool: key s visible to query t iff s ≤ t and same sample."""
    T = doc.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()  # (T, T)
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]  # (B, 1, T, T)


def ttt_mask(doc: torch.Tensor, step: int) -> torch.Tensor:
    """Dense mask of step ``step`` for one row: doc (T,) → bool (T, (step+1)·T), blocks [step 0 | … | step].

    For documentation and tests; training uses :class:`~.attention.TTTAttention`, which never builds it."""
    T = doc.shape[0]
    eye = torch.eye(T, dtype=torch.bool, device=doc.device)  # (T, T)
    return torch.cat([step0_mask(doc[None])[0, 0]] + [eye] * step, dim=1)  # (T, (step+1)·T)


def sample_starts(doc: torch.Tensor) -> torch.Tensor:
    """doc (B, T), samples contiguous (packed rows) → (B, T) int64: the first position of each position's sample."""
    T = doc.shape[1]
    new = torch.ones_like(doc, dtype=torch.bool)  # (B, T): a sample starts here
    new[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return torch.where(new, torch.arange(T, device=doc.device), 0).cummax(1).values  # (B, T)


def ttt_mask_mod(doc: torch.Tensor, q_at: torch.Tensor, kv_at: torch.Tensor):
    """flex_attention mask_mod of one TTT step over keys [step 0 | step 1 | …]: query q at position q_at[q] (Q,),
    key kv at position kv_at[kv] (KV,; the first T entries are step 0's keys 0..T-1). doc (B, T+1): the samples
    and, at T, a value no sample has. Key kv is visible to query t iff it is at t, or a step-0 key of t's sample
    at or before t; padding (position T) sees only padding and is seen by nothing else."""
    T = doc.shape[1] - 1

    def mask_mod(b, h, q, kv):
        t, s = q_at[q], kv_at[kv]
        return (s == t) | ((kv < T) & (s <= t) & (doc[b, s] == doc[b, t]))

    return mask_mod


def ttt_block_mask(start: torch.Tensor, ats: list[torch.Tensor], mask_mod):
    """BlockMask of step j = len(ats)-1 for :class:`~.attention.FlexTTTAttention`, built from block bounds
    (O(blocks), no Q×KV evaluation). start (B, T): :func:`sample_starts`; ats[i] (N_i,) the positions of step i's
    queries and keys (ats[0] = 0..T-1; later ascending, then T for padding), every N_i % BLOCK == 0.

    Query block of positions a..b (a its first, b its last real one) needs the step-0 key blocks in
    [start[a], b] (full where they lie in [start[b], a], a block without padding) and, for each step i ≥ 1, the
    blocks of ats[i] holding positions a..b (and padding); blocks listed but empty only cost time."""
    T, q = start.shape[1], ats[-1].view(-1, BLOCK)  # (nq, BLOCK)
    a, b_any = q[:, 0].contiguous(), q[:, -1].contiguous()  # (nq,) first position, last entry (T: padding)
    b = q.masked_fill(q >= T, -1).max(1).values  # (nq,) last real position, -1 if none
    kb = torch.arange(T // BLOCK, device=q.device) * BLOCK  # (n0,) first key of each step-0 block
    lo = start[:, a.clamp(max=T - 1)]  # (B, nq)
    parts = [(kb + BLOCK > lo[..., None]) & (kb <= b[:, None])]  # (B, nq, n0) step-0 blocks
    hi_start = start[:, b.clamp(min=0)]  # (B, nq)
    full = [(kb >= hi_start[..., None]) & (kb + BLOCK - 1 <= a[:, None]) & (b_any < T)[:, None]]  # (B, nq, n0)
    for at in ats[1:]:
        i0 = torch.searchsorted(at, a) // BLOCK  # (nq,) blocks of at holding a .. b_any
        i1 = (torch.searchsorted(at, b_any, right=True) - 1) // BLOCK
        kbi = torch.arange(at.shape[0] // BLOCK, device=q.device)  # (ni,)
        parts.append(((kbi >= i0[:, None]) & (kbi <= i1[:, None])).expand(lo.shape[0], -1, -1))  # (B, nq, ni)
        full.append(torch.zeros_like(parts[-1]))
    full = torch.cat(full, -1)  # (B, nq, nkv)
    partial = torch.cat(parts, -1) & ~full  # (B, nq, nkv)
    return block_mask_from_tables(partial, full, mask_mod, (q.numel(), sum(x.shape[0] for x in ats)))


def block_mask_from_tables(partial: torch.Tensor, full: torch.Tensor, mask_mod, seq_lengths: tuple[int, int]):
    """Block tables (B, nq, nkv) bool, partial (mask_mod evaluated) and full → BlockMask (BLOCK × BLOCK)."""
    from torch.nn.attention.flex_attention import BlockMask

    def ordered(d):  # (B, nq, nkv) → counts (B, 1, nq), indices (B, 1, nq, nkv) int32, listed ones first, ascending
        idx = torch.sort(d.to(torch.int8), dim=-1, descending=True, stable=True).indices
        return d.sum(-1, dtype=torch.int32)[:, None], idx.to(torch.int32)[:, None]

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=seq_lengths)
