"""Training-time test (TTT): the draft unrolled ``ttt_steps`` times on a batch, the per-step loss and accuracy.

Alignment (x = token ids, g = target aux states fc-projected, d^j = the draft's pre-norm output of step j,
p_s = the target's next-token distribution at position s, i.e. from h[N] at s, predicting x_{s+1})::

    ids        x0    x1    x2    x3    x4    x5
    aux        g0    g1    g2    g3    g4    g5
    step 0     (g0, x1) → x2 ~ p1    (g1, x2) → x3 ~ p2    ...   align (x1, g0): g_t reads x_{t+1}
    step 1     (d⁰0, x2) → x3 ~ p2   (d⁰1, x3) → x4 ~ p3   ...   own hidden d⁰_t, data token x_{t+2}
    step j     (d^{j-1}_t, x_{t+1+j}) → x_{t+2+j} ~ p_{t+1+j},  RoPE position t+j,
               counted iff t+1+j is in the same sample and loss_mask[t+1+j] (x_{t+2+j} is assistant text)

Position t of step j is the j-th drafted token of a chain that starts after the target accepted x_{t+1}: at
serving time the draft reads (g_t, x_{t+1}) at position t, then (d⁰_t, x̂_{t+2}) at position t+1, and so on.
Tokens stay teacher-forced from the data (x_{t+2}, not the draft's argmax — feeding the argmax was a public
bug); only the hidden state is the draft's own.

Attention of the unrolled steps: keys grow by one "layer" per step. A step-j query at t sees step-0 keys at
positions ≤ t of its own sample (the engine's KV cache after the extend pass: (g_s, x_{s+1}) for s ≤ t) and,
for each later step i = 1..j, only the key at t (its own chain's earlier drafted positions). T = 4, step 2
(rows = queries t, columns = keys [step 0 | step 1 | step 2])::

    t=0  1 0 0 0 | 1 0 0 0 | 1 0 0 0
    t=1  1 1 0 0 | 0 1 0 0 | 0 1 0 0
    t=2  1 1 1 0 | 0 0 1 0 | 0 0 1 0
    t=3  1 1 1 1 | 0 0 0 1 | 0 0 0 1

This is what an engine computes, and what speculators and SpecForge 0.2.0 compute too (SpecForge in both its
attention backends; an earlier version of this docstring said SpecForge hides step-0 keys t-j+1..t from step j —
it does not; SafeAILab/EAGLE#247 discusses the original EAGLE-3 code). One difference from speculators is kept:
its step-j shift does not check sample boundaries in a packed row, so its last j positions of each sample are
scored against the next sample's tokens; here they are not counted (``counted`` below).

Two implementations of the same step (``fast``): the plain one (:class:`TTTAttention`: only the step-0 block
is a T×T product, the later blocks are diagonals computed as dot products, so memory is O(T²) for any number of
steps; steps ≥ 1 only at the positions whose chain the loss reads, :func:`chain_rows`) and the fast one
(:class:`FlexTTTAttention` on CUDA: flex_attention over [step 0 | … | step j] keys with a block-sparse mask,
never a T×T tensor; :func:`soft_ce` for the loss: the soft cross-entropy and its gradient computed with the
lm_head product, the fp32 softmax one chunk of tokens at a time, the soft targets read through slices or row
indices instead of shifted copies; steps ≥ 1 at the chain rows too, padded to one of few lengths on CUDA,
:func:`flex_rows`). Both give the same loss and gradients: tests/test_ttt.py compares them on CPU in fp32 (there
the fast path keeps the plain attention: flex_attention has no CPU backward; its forward, the compacted flex
path included, is compared there too); on the H200 under bf16 autocast they agreed to 2e-7 in the loss and
within 1 % in each gradient's norm, bf16 rounding (benchmarks/h200/train_step_checks.json, measured before the
fast path's steps ≥ 1 ran at the chain rows only).

Loss of step j: soft cross-entropy −Σ_v p_{t+1+j}(v) log q(v) over the draft vocabulary, averaged over the
counted positions whose target top-1 is in the draft vocabulary (target_head.py), weighted step_decay**j.
Accuracy of step j: draft argmax == target argmax (draft-vocab space) over ALL counted positions (an
out-of-vocabulary top-1 counts as a miss). τ_sim = 1 + Σ_k Π_{i≤k} acc_i.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from eaglepipe.model.draft import Eagle3Draft, repeat_kv
from eaglepipe.model.target_head import SoftTargets


@dataclass
class Batch:
    """Samples packed on the token axis; ``doc`` tells them apart (positions restart at 0 in each sample)."""

    input_ids: torch.Tensor  # (B, T) int64
    positions: torch.Tensor  # (B, T) int64, position inside its sample
    doc: torch.Tensor  # (B, T) int64 sample index in the row, -1 on padding
    loss_mask: torch.Tensor  # (B, T) bool, loss_mask[t] = x_{t+1} is assistant text
    aux: torch.Tensor  # (B, T, L, Ht)
    last: torch.Tensor  # (B, T, H) h[N] pre-norm
    top_in_vocab: torch.Tensor | None = None  # (B, T) bool, the target's top-1 is in the draft vocab (if known)

    def to(self, device) -> "Batch":
        return Batch(**{k: None if v is None else v.to(device) for k, v in vars(self).items()})


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """y[:, t] = x[:, t+n], ``fill`` past the end (dim 1)."""
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def step0_mask(doc: torch.Tensor) -> torch.Tensor:
    """(B, T) sample ids → (B, 1, T, T) bool: key s visible to query t iff s ≤ t and same sample."""
    T = doc.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()  # (T, T)
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]  # (B, 1, T, T)


def ttt_mask(doc: torch.Tensor, step: int) -> torch.Tensor:
    """Dense mask of step ``step`` for one row: doc (T,) → bool (T, (step+1)·T), blocks [step 0 | … | step].

    For documentation and tests; training uses :class:`TTTAttention`, which never builds it."""
    T = doc.shape[0]
    eye = torch.eye(T, dtype=torch.bool, device=doc.device)  # (T, T)
    return torch.cat([step0_mask(doc[None])[0, 0]] + [eye] * step, dim=1)  # (T, (step+1)·T)


class TTTAttention:
    """The ``attend`` of the unrolled steps: call once per step, in order; remembers each step's keys/values.

    ``at``, set before a step: the positions (n,) int64, ascending, that the step's queries are at (B = 1), or
    None for all T. Step 0 is always at all T (its keys are every later step's context); a later step may be at
    a subset of the previous step's positions (:func:`chain_rows`), its diagonal keys picked to match. Padding
    entries T at the end (:func:`static_rows`) attend as position T-1; their outputs are never scored."""

    def __init__(self, doc: torch.Tensor):
        self.mask0 = step0_mask(doc)  # (B, 1, T, T)
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []
        self.rows: list[torch.Tensor | None] = []
        self.at: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        r = self.at
        self.ks.append(k)  # (B, nkv, n, hd)
        self.vs.append(v)
        self.rows.append(r)
        n_rep, T = q.shape[1] // k.shape[1], self.ks[0].shape[2]
        scale = q.shape[-1] ** -0.5
        k0, v0 = repeat_kv(self.ks[0], n_rep), repeat_kv(self.vs[0], n_rep)  # (B, nh, T, hd)
        s0 = (q @ k0.transpose(-1, -2)) * scale  # (B, nh, n, T)
        s0 = s0.masked_fill(~(self.mask0 if r is None else self.mask0[:, :, r.clamp(max=T - 1)]), float("-inf"))
        ks = [_rows_at(ki, ri, r) for ki, ri in zip(self.ks[1:], self.rows[1:])]  # (B, nkv, n, hd) each
        vs = [_rows_at(vi, ri, r) for vi, ri in zip(self.vs[1:], self.rows[1:])]
        diag = [(q * repeat_kv(ki, n_rep)).sum(-1, keepdim=True) * scale for ki in ks]  # (B, nh, n, 1) each
        p = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)  # (B, nh, n, T+j)
        y = p[..., :T] @ v0  # (B, nh, n, hd)
        for i, vi in enumerate(vs):
            y = y + p[..., T + i : T + i + 1] * repeat_kv(vi, n_rep)  # (B, nh, n, hd)
        return y


def _rows_at(x: torch.Tensor, have: torch.Tensor | None, want: torch.Tensor | None, dim: int = 2) -> torch.Tensor:
    """x, whose ``dim`` holds n rows at positions ``have`` ((n,) int64 ascending; None: 0..n-1) → its rows at
    ``want`` ⊆ have ((m,) ascending; None: x itself). Padding entries of want (past every position in have, as
    :func:`flex_rows` appends) take the last row; whatever they compute is never scored."""
    if want is None:
        return x
    i = want if have is None else torch.searchsorted(have, want)
    return x.index_select(dim, i.clamp(max=x.shape[dim] - 1))


def chain_rows(trained: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The positions each TTT step must compute, from each step's ``trained`` mask ((1, T) bool, B = 1).

    Step j at t reads only step j−1 at t (its hidden state and diagonal key) and the step-0 keys, so step j ≥ 1
    need not run where no step j' ≥ j trains: rows_j = {t : trained_j'[t] for some j' ≥ j}, (n_j,) int64,
    ascending, nested (rows_{j+1} ⊆ rows_j). Step 0 → None (all T: its keys are every later step's context).
    Prompt positions drop out of every later step (a third of the CPU defaults' tokens are assistant text)."""
    need = torch.zeros_like(trained[0][0])
    rows: list[torch.Tensor | None] = [None] * len(trained)
    for j in range(len(trained) - 1, 0, -1):
        need = need | trained[j][0]
        rows[j] = need.nonzero().squeeze(1)
    return rows


BLOCK = 128  # flex_attention's block size; the fast path pads the row to a multiple of it
# flex_attention's Triton kernel needs head_dim >= 16 (torch/_inductor/kernel/flex/flex_attention.py, "NYI:
# embedding dimension ... must be at least 16"; torch 2.11 on the H200, 2026-12-03): below it the plain attention
FLEX_MIN_HEAD_DIM = 16


def uses_flex(head_dim: int, device: torch.device | str) -> bool:
    """Whether :func:`ttt_unroll_fast` attends through :class:`FlexTTTAttention` (padded rows) for a draft of
    ``head_dim`` on ``device``: on CUDA with head_dim >= FLEX_MIN_HEAD_DIM; else the plain :class:`TTTAttention`
    (flex_attention has no fast CPU kernel, and Inductor's has no kernel for smaller heads)."""
    return torch.device(device).type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM


def sample_starts(doc: torch.Tensor) -> torch.Tensor:
    """doc (B, T), samples contiguous (packed rows) → (B, T) int64: the first position of each position's sample."""
    T = doc.shape[1]
    new = torch.ones_like(doc, dtype=torch.bool)
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
    """BlockMask of step j = len(ats)-1 for :class:`FlexTTTAttention`, built from block bounds (O(blocks), no
    Q×KV evaluation). start (B, T): :func:`sample_starts`; ats[i] (N_i,) the positions of step i's queries and
    keys (ats[0] = 0..T-1; later ascending, then T for padding), every N_i % BLOCK == 0.

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
    full = [(kb >= hi_start[..., None]) & (kb + BLOCK - 1 <= a[:, None]) & (b_any < T)[:, None]]
    for at in ats[1:]:
        i0 = torch.searchsorted(at, a) // BLOCK  # (nq,) blocks of at holding a .. b_any
        i1 = (torch.searchsorted(at, b_any, right=True) - 1) // BLOCK
        kbi = torch.arange(at.shape[0] // BLOCK, device=q.device)  # (ni,)
        parts.append(((kbi >= i0[:, None]) & (kbi <= i1[:, None])).expand(lo.shape[0], -1, -1))  # (B, nq, ni)
        full.append(torch.zeros_like(parts[-1]))
    full = torch.cat(full, -1)  # (B, nq, nkv)
    partial = torch.cat(parts, -1) & ~full
    return block_mask_from_tables(partial, full, mask_mod, (q.numel(), sum(x.shape[0] for x in ats)))


def block_mask_from_tables(partial: torch.Tensor, full: torch.Tensor, mask_mod, seq_lengths: tuple[int, int]):
    """Block tables (B, nq, nkv) bool, partial (mask_mod evaluated) and full → BlockMask (BLOCK × BLOCK)."""
    from torch.nn.attention.flex_attention import BlockMask

    def ordered(d):  # (B, nq, nkv) → counts (B, 1, nq), indices (B, 1, nq, nkv) int32, listed ones first, ascending
        idx = torch.sort(d.to(torch.int8), dim=-1, descending=True, stable=True).indices
        return d.sum(-1, dtype=torch.int32)[:, None], idx.to(torch.int32)[:, None]

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=seq_lengths)


_flex = None


def flex_attention_fn():
    """flex_attention, compiled once per process on CUDA (eager flex is a dense reference implementation), with
    static shapes as :func:`compile_draft`'s."""
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex = torch.compile(flex_attention, dynamic=False) if torch.cuda.is_available() else flex_attention
    return _flex


class FlexTTTAttention:
    """The ``attend`` of the unrolled steps through flex_attention (same mask as :class:`TTTAttention`).

    doc: (B, T) with T % BLOCK == 0, samples contiguous. ``at`` as :class:`TTTAttention`'s, except that a later
    step's (N,) has N % BLOCK == 0 and ends in padding entries T (:func:`flex_rows`). Keys are
    [step 0 (T) | step 1 (N_1) | … | step j (N_j)]; a query block sees the step-0 blocks of its samples' causal
    past and the blocks of each later step that hold its positions, so step j ≥ 1 costs about
    N_j · (its samples' step-0 span + j·BLOCK) per head. Raises AssertionError when T % BLOCK != 0."""

    def __init__(self, doc: torch.Tensor, buffers: dict | None = None):
        B, T = doc.shape
        assert T % BLOCK == 0, f"FlexTTTAttention needs T % {BLOCK} == 0, got T = {T}"
        self.buffers = buffers  # not None: the mask_mod's tensors live at fixed addresses (:func:`fixed_address`)
        self.doc = torch.cat([doc, doc.min(1, keepdim=True).values - 1], 1)  # (B, T+1): T in no sample
        self.start = sample_starts(doc)  # (B, T)
        self.ats = [torch.arange(T, device=doc.device)]  # positions of each step's queries and keys
        self.at: torch.Tensor | None = None
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []

    @torch.compiler.disable
    def mask(self):
        """Block mask of the next step, at ``at`` (built eagerly: the tables depend on the data)."""
        if self.ks:  # step ≥ 1
            self.ats.append(self.ats[0] if self.at is None else self.at)
        step = len(self.ats) - 1
        tensors = (self.doc, self.ats[-1], torch.cat(self.ats))  # keys at (T + Σ N_i,)
        if self.buffers is not None:
            tensors = tuple(fixed_address(self.buffers, (step, i), x) for i, x in enumerate(tensors))
        bm = ttt_block_mask(self.start, self.ats, ttt_mask_mod(*tensors))
        if self.buffers is not None:  # the block tables too (a guess at the inputs still moving: fixed_address)
            for name, x in list(vars(bm).items()):
                if isinstance(x, torch.Tensor):
                    setattr(bm, name, fixed_address(self.buffers, (step, name), x))
        return bm

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        bm = self.mask()
        self.ks.append(k)  # (B, nkv, N_j, hd)
        self.vs.append(v)
        K = torch.cat(self.ks, dim=2) if len(self.ks) > 1 else k  # (B, nkv, T + Σ N_i, hd)
        V = torch.cat(self.vs, dim=2) if len(self.vs) > 1 else v
        return flex_attention_fn()(q, K, V, block_mask=bm, enable_gqa=q.shape[1] != k.shape[1])


def fixed_address(buffers: dict, key: tuple, x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a tensor kept in ``buffers`` under (key, shape, dtype, device): the same storage on every
    call with that key, ``x`` copied in (the first call keeps a clone). Inductor's CUDA graph trees take the
    tensors a mask_mod closes over as static inputs and record the graph again whenever one's address changes
    (torch/_inductor/cudagraph_trees.py, "static input data pointer changed": on the H200, 2026-12-04, every step
    of benchmarks/train_step.py's -cg rows did, at a sixth of the uncaptured speed; with only the mask_mod's
    tensors fixed, two other inputs of flex_attention still moved, which two is not known: the block tables are
    kept fixed as well, on the guess that they are those).
    Key by TTT step: a step's tensors must survive until its backward, so steps of one training step never share
    one."""
    k = (key, tuple(x.shape), x.dtype, x.device)
    buf = buffers.get(k)
    if buf is None:
        buffers[k] = buf = x.clone()
    else:
        buf.copy_(x)
    return buf


class SoftCE(torch.autograd.Function):
    """Σ_t w_t · (−Σ_v p_tv log softmax(x_t Wᵀ)_v) and argmax_v (x_t Wᵀ), ``chunk`` tokens at a time.

    x (N, H) the normed draft output, W (Vd, H) lm_head, p (M, Vd) soft targets, w (N,) fp32 weights, p_rows
    (N,) int64 or None: x's row i is scored against p[p_rows[i]] (None: p[i], M = N).
    Unless ``dense``, only the n rows with w > 0 are multiplied (the rest add nothing to the loss or the gradient;
    their argmax is returned as 0): on real data the loss reads assistant tokens only (about a third of the CPU
    defaults' positions). ``dense`` multiplies all N rows (n = N), so that no shape depends on the data and
    nothing waits for the device (a CUDA graph's capture: :func:`static_rows`). The gradient is computed with
    the loss (d/dz = w·(softmax(z)·Σp − p)): the softmax runs one chunk of logits at a time in fp32, dz is kept
    in the product dtype (n, Vd), and the two gradient products are one GEMM each; backward only scales them.
    Under autocast the products run in its dtype (as ``nn.Linear`` would).
    """

    @staticmethod
    def forward(ctx, x, W, p, w, chunk: int, grad: bool, p_rows, dense: bool = False):
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        need_x, need_w = grad and ctx.needs_input_grad[0], grad and ctx.needs_input_grad[1]
        N, idx = x.shape[0], None if dense else (w > 0).nonzero().squeeze(1)  # (n,) the rows that count
        rows = idx if p_rows is None else p_rows if idx is None else p_rows[idx]  # p's rows for x's (n,), or None
        if idx is not None:
            x, w = x[idx], w[idx]  # (n, H), (n,)
        p = p if rows is None else p.index_select(0, rows)  # (n, Vd)
        with torch.autocast(dev, enabled=False):
            xd, Wd = x.to(dt), W.to(dt)  # (n, H), (Vd, H)
            loss = torch.zeros((), dtype=torch.float32, device=x.device)
            arg = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)  # (n,)
            dz = torch.empty(x.shape[0], W.shape[0], dtype=dt, device=x.device) if need_x or need_w else None
            for a in range(0, x.shape[0], chunk):
                z = xd[a : a + chunk] @ Wd.T  # (c, Vd) in dt
                ce, arg[a : a + chunk], g = _soft_ce_chunk(z, p[a : a + chunk], w[a : a + chunk], dz is not None)
                loss = loss + ce
                if dz is not None:
                    dz[a : a + chunk] = g  # (c, Vd)
            gx = (dz @ Wd).to(x.dtype) if need_x else None  # (n, H)
            gW = (dz.T @ xd).float() if need_w else None  # (Vd, H)
        if idx is not None:  # back to all N rows: zeros (gradient) and 0 (argmax) where w = 0
            gx = None if gx is None else x.new_zeros(N, x.shape[1]).index_copy_(0, idx, gx)  # (N, H)
            arg = arg.new_zeros(N).index_copy_(0, idx, arg)  # (N,)
        ctx.save_for_backward(gx, gW)
        ctx.w_dtype = W.dtype
        ctx.mark_non_differentiable(arg)
        return loss, arg  # (), (N,)

    @staticmethod
    def backward(ctx, grad_loss, _grad_arg):
        gx, gW = ctx.saved_tensors
        return (None if gx is None else gx * grad_loss.to(gx.dtype),
                None if gW is None else (gW * grad_loss).to(ctx.w_dtype), None, None, None, None, None, None)


def _soft_ce_chunk_impl(z: torch.Tensor, p: torch.Tensor, w: torch.Tensor, grad: bool):
    """z (c, Vd) logits, p (c, Vd), w (c,) → (Σ w·ce, argmax (c,), dloss/dz (c, Vd) in z's dtype or None)."""
    zf = z.float()
    logq = torch.log_softmax(zf, dim=-1)  # (c, Vd) fp32
    pf = p.float()
    ce = -(pf * logq).sum(-1)  # (c,)
    g = ((logq.exp() * pf.sum(-1, keepdim=True) - pf) * w[:, None]).to(z.dtype) if grad else None  # (c, Vd)
    return (ce * w).sum(), zf.argmax(-1), g


_soft_ce_compiled = None


def _soft_ce_chunk(z, p, w, grad: bool):
    global _soft_ce_compiled
    if not z.is_cuda:
        return _soft_ce_chunk_impl(z, p, w, grad)
    if _soft_ce_compiled is None:  # one fused kernel per pass instead of ~8 full-size elementwise passes
        _soft_ce_compiled = torch.compile(_soft_ce_chunk_impl, dynamic=True)
    return _soft_ce_compiled(z, p, w, grad)


def soft_ce(x: torch.Tensor, W: torch.Tensor, p: torch.Tensor, w: torch.Tensor, chunk: int | None = None,
            p_rows: torch.Tensor | None = None, dense: bool = False):
    """See :class:`SoftCE`; x (..., H), p (..., Vd), w (...), p_rows None or (...) int64 rows of p flattened to
    (-1, Vd) (None: p has x's shape) → (Σ w·ce scalar fp32, argmax (...))."""
    lead = x.shape[:-1]
    chunk = chunk or max(256, (1 << 25) // W.shape[0])  # ~32M logits (128 MB fp32) per chunk
    loss, arg = SoftCE.apply(x.reshape(-1, x.shape[-1]), W, p.reshape(-1, p.shape[-1]), w.reshape(-1).float(),
                             chunk, torch.is_grad_enabled(), None if p_rows is None else p_rows.reshape(-1), dense)
    return loss, arg.view(lead)


@dataclass
class StepInputs:
    """What step j reads and is scored on, per position t (all (B, T) unless noted)."""

    ids: torch.Tensor  # x_{t+1+j}, teacher-forced token embedded at t
    positions: torch.Tensor  # RoPE position + j
    p: torch.Tensor  # (B, T, Vd) soft target p_{t+1+j}
    top: torch.Tensor  # target argmax (draft id) at t+1+j
    counted: torch.Tensor  # bool: t+1+j in the same sample and loss_mask[t+1+j]
    trained: torch.Tensor  # bool: counted and the target's top-1 is in the draft vocabulary


def counted_trained(batch: Batch, soft: SoftTargets, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step j's ``counted`` and ``trained`` masks, (B, T) bool each (:class:`StepInputs`)."""
    n = 1 + j
    counted = (shift_left(batch.doc, n, -2) == batch.doc) & shift_left(batch.loss_mask, n, False)  # (B, T)
    return counted, counted & shift_left(soft.top_in_vocab, n, False)


def align_step(batch: Batch, soft: SoftTargets, j: int) -> StepInputs:
    """Shift the data for TTT step j (see the module docstring's table)."""
    n = 1 + j
    counted, trained = counted_trained(batch, soft, j)
    return StepInputs(
        ids=shift_left(batch.input_ids, n, 0),  # (B, T)
        positions=batch.positions + j,  # (B, T)
        p=shift_left(soft.p, n, 0.0),  # (B, T, Vd)
        top=shift_left(soft.top, n, 0),  # (B, T)
        counted=counted,
        trained=trained,  # (B, T)
    )


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar, Σ_j decay^j · loss_j (differentiable)
    step_loss: torch.Tensor  # (S,) detached mean CE per step
    correct: torch.Tensor  # (S,) int64 counted positions where draft argmax == target argmax
    counted: torch.Tensor  # (S,) int64 counted positions
    trained: torch.Tensor  # (S,) int64 positions that enter the loss (top-1 in vocabulary)


def ttt_unroll(
    draft: Eagle3Draft, embed: torch.Tensor, batch: Batch, soft: SoftTargets, steps: int, decay: float,
    fast: bool = False,
) -> TTTResult:
    """Run ``steps`` TTT steps. ``draft`` may be DDP-unwrapped or not (only its submodules are called).

    embed: (V, H) frozen target embeddings. Returns the weighted loss and per-step counts. ``fast``: the
    implementation of :func:`ttt_unroll_fast` (same results). With one packed row (B = 1, as training collates),
    steps ≥ 1 run only at the positions whose chain a later loss reads (:func:`chain_rows`): the same loss and
    gradients, less work where much of the row is prompt.
    """
    if fast:
        return ttt_unroll_fast(draft, embed, batch, soft, steps, decay)
    hidden = draft.project(batch.aux.to(embed.dtype))  # (B, T, H) step-0 hidden: fc(g_t)
    att = TTTAttention(batch.doc)
    one_row = hidden.shape[0] == 1
    rows = chain_rows([counted_trained(batch, soft, j)[1] for j in range(steps)]) if one_row else [None] * steps
    loss = hidden.new_zeros(())
    step_loss, correct, counted, trained = [], [], [], []
    for j, r in enumerate(rows):
        s = align_step(batch, soft, j)
        ids, pos, tr = (s.ids, s.positions, s.trained) if r is None else \
            (s.ids[:, r], s.positions[:, r], s.trained[:, r])  # (B, n) each
        hidden = _rows_at(hidden, rows[j - 1] if j else None, r, dim=1)  # (B, n, H)
        att.at = r
        out = draft.layer(F.embedding(ids, embed), hidden, pos, att.attend)  # (B, n, H) pre-norm; no grad into embed
        logits = draft.logits(out[tr]).float()  # (m, Vd): only where the loss reads them (ascending t, as p's rows)
        ce = -(s.p[s.trained] * torch.log_softmax(logits, dim=-1)).sum(-1)  # (m,)
        loss_j = ce.sum() / s.trained.sum().clamp(min=1)
        loss = loss + decay**j * loss_j
        with torch.no_grad():
            step_loss.append(loss_j.detach())
            correct.append((logits.argmax(-1) == s.top[s.trained]).sum())  # OOV top-1: a miss (not trained)
            counted.append(s.counted.sum())
            trained.append(s.trained.sum())
        hidden = out  # the draft's own pre-norm output feeds step j+1
    return TTTResult(loss, torch.stack(step_loss), torch.stack(correct), torch.stack(counted), torch.stack(trained))


def pad_to(x: torch.Tensor, T: int, fill) -> torch.Tensor:
    """(B, t, ...) → (B, T, ...) with ``fill`` after position t (dim 1)."""
    return x if x.shape[1] == T else torch.cat([x, x.new_full((x.shape[0], T - x.shape[1], *x.shape[2:]), fill)], 1)


PAD_DOC = 1 << 30  # ``doc`` of the padding :func:`pad_batch` appends: no real sample's index, never counted


def padded_length(max_tokens: int) -> int:
    """The one row length of the fast path on CUDA: ``train.batch_tokens`` rounded up to BLOCK."""
    return -(-max_tokens // BLOCK) * BLOCK


def pad_batch(batch: Batch, T: int) -> Batch:
    """``batch`` (B, t) → (B, T) with a padding sample appended (doc PAD_DOC, loss_mask False, zero ids,
    positions and features; top_in_vocab False), so every row of a run has one shape and torch.compile and
    flex_attention compile once (H200, 2026-12-01: rows of varying length recompiled the draft layer past
    dynamo's recompile limit of 8, after which it ran eager, flex_attention unfused). The padding is never
    counted: no position of it has loss_mask, and no real position's successor lies in it (doc differs).
    Raises ValueError when t > T."""
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


BUCKETS = 8  # the flex path's later-step query lengths: multiples of T/BUCKETS (:func:`flex_rows`)


def flex_rows(rows: list[torch.Tensor | None], T: int) -> list[torch.Tensor | None]:
    """:func:`chain_rows` for :class:`FlexTTTAttention` over a row of T positions (T % BLOCK == 0): every later
    step's (n_j,) padded with T to one length N = n_1 (the largest: rows are nested) rounded up to a multiple of
    T/BUCKETS in BLOCKs (at least one such multiple, at most T).

    Why buckets and not the exact n_j: torch.compile specializes on shapes, so exact counts would compile the
    draft layer anew for almost every row (pad_batch's docstring: past the recompile limit it runs eager, flex
    unfused). With one N per row for all later steps and N one of ≤ BUCKETS sizes, the graphs are one per
    (step, N, grad mode): ≤ 1 + BUCKETS·(steps−1) per grad mode, and a run whose rows carry a similar share of
    assistant text meets two or three Ns. The price: up to T/BUCKETS padded queries per later step (their keys are
    seen by padding only, their outputs are never scored)."""
    if len(rows) < 2:
        return rows
    N = bucket_length(rows[1].numel(), T)
    return [None] + [_pad_rows(r, N, T) for r in rows[1:]]


def _pad_rows(r: torch.Tensor, N: int, T: int) -> torch.Tensor:
    """(n,) positions → (N,), padding entries T appended (a position no sample has)."""
    return torch.cat([r, r.new_full((N - r.numel(),), T)])


def bucket_length(n: int, T: int) -> int:
    """n rows of a row of T positions → the padded length :func:`flex_rows` gives them: n rounded up to a multiple
    of T/BUCKETS in BLOCKs (at least one such multiple, at most T)."""
    g = BLOCK * -(-T // (BLOCK * BUCKETS))  # bucket width, a multiple of BLOCK, ≤ T
    return min(T, max(g, -(-n // g) * g))


def static_rows(batch: Batch, top_in_vocab: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The rows of a one-row batch (B = 1, T positions) that :func:`ttt_unroll_fast` given ``rows`` computes without
    waiting for the device: [step 0's scored positions (its ``trained`` ones), then :func:`flex_rows`' later steps],
    each (N_i,) int64 ascending, padded with T to :func:`bucket_length` (step 0's length and the later steps' one
    length are each one of ≤ BUCKETS sizes, so a CUDA graph per pair covers a run). Computed here, before a
    graph's replay: it reads the masks back from the device (``nonzero``). top_in_vocab: (1, T) bool, the soft
    targets' (what :func:`counted_trained` reads of them). Raises ValueError when B != 1."""
    if batch.input_ids.shape[0] != 1:
        raise ValueError(f"static_rows: one packed row (B = 1), got B = {batch.input_ids.shape[0]}")
    T = batch.input_ids.shape[1]
    soft = SimpleNamespace(top_in_vocab=top_in_vocab)
    trained = [counted_trained(batch, soft, j)[1] for j in range(steps)]  # (1, T) bool each
    r0 = trained[0][0].nonzero().squeeze(1)
    return [_pad_rows(r0, bucket_length(r0.numel(), T), T), *flex_rows(chain_rows(trained), T)[1:]]


def _step_ce(draft: Eagle3Draft, out: torch.Tensor, soft: SoftTargets, tr: torch.Tensor, n: int,
             at: torch.Tensor | None, dense: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Step j's (n = 1+j) Σ w·ce (scalar fp32) and hits (int64: trained positions where the draft's argmax is the
    target's), from its pre-norm output ``out`` (B, ·, H) at positions ``at`` (None: 0, 1, …; else (N,), B = 1,
    padding ≥ T) and its trained mask tr (B, T). p_{t+1+j} is read through a slice or row indices of soft.p,
    never a shifted copy. ``dense``: :class:`SoftCE`'s (every row of ``out`` multiplied; with ``at`` only)."""
    T, W = tr.shape[1], draft.lm_head.weight
    if at is None:
        m = T - n  # positions t < m have a successor x_{t+1+j} in the row
        if m <= 0:
            return out.sum() * 0.0, tr.sum()
        ce, arg = soft_ce(draft.norm(out[:, :m]), W, soft.p[:, n:], tr[:, :m])  # (), (B, m)
        return ce, (tr[:, :m] & (arg == soft.top[:, n:])).sum()
    s = (at + n).clamp(max=T - 1)  # (N,) row of p_{t+1+j} (inside the row wherever t is trained)
    w = tr[:, at.clamp(max=T - 1)]  # (1, N): padding reads position T-1, never trained (nothing follows it)
    ce, arg = soft_ce(draft.norm(out), W, soft.p, w, p_rows=s[None], dense=dense)  # (), (1, N)
    return ce, (w & (arg == soft.top[:, s])).sum()


def ttt_unroll_fast(
    draft: Eagle3Draft, embed: torch.Tensor, batch: Batch, soft: SoftTargets, steps: int, decay: float,
    rows: list[torch.Tensor] | None = None,
) -> TTTResult:
    """:func:`ttt_unroll` computed faster, same results. On CUDA (head_dim >= 16: :func:`uses_flex`) the row is padded
    to a multiple of BLOCK (padding is a sample of its own, never counted) and attention runs through
    :class:`FlexTTTAttention`. With one row (B = 1), steps ≥ 1 run only at :func:`chain_rows`, on the flex path
    padded to one of few lengths (:func:`flex_rows`); on CUDA without flex every position (the compiled plain
    attention takes no padding, and exact counts would recompile it per row). Positions t ≥ T-1-j are never
    counted at step j (nothing follows them in the row), so they are not scored.

    ``rows``: :func:`static_rows` of this batch (B = 1, T a multiple of BLOCK where flex runs: :func:`pad_batch`).
    Then no shape depends on the data and no op waits for the device, so the step can be captured as a CUDA
    graph (:mod:`eaglepipe.train.graphed`): step 0 is scored at rows[0] (every row multiplied, padding included), later
    steps run at rows[1:]. Same results. Raises ValueError when the row would need padding here."""
    B, T = batch.input_ids.shape
    dev = batch.input_ids.device
    flex = uses_flex(draft.cfg.head_dim, dev)
    Tp = -(-T // BLOCK) * BLOCK if flex else T
    if rows is not None and Tp != T:
        raise ValueError(f"ttt_unroll_fast with rows: the row must be padded to a multiple of {BLOCK} (pad_batch)")
    aux = batch.aux if torch.is_autocast_enabled(dev.type) else batch.aux.to(embed.dtype)  # no fp32 copy
    hidden = pad_to(draft.project(aux), Tp, 0.0)  # (B, Tp, H) step-0 hidden: fc(g_t)
    ids, positions = pad_to(batch.input_ids, Tp, 0), pad_to(batch.positions, Tp, 0)  # (B, Tp)
    doc = pad_to(batch.doc, Tp, -1 if T == Tp else int(batch.doc.max()) + 1)  # (B, Tp)
    att = FlexTTTAttention(doc, draft.mask_buffers) if flex else TTTAttention(doc)
    masks = [counted_trained(batch, soft, j) for j in range(steps)]  # (B, T) counted, trained per step
    static, score0 = rows is not None, None
    if static:
        score0, rows = rows[0], [None, *rows[1:]]
    elif B == 1 and (flex or dev.type != "cuda"):
        rows = chain_rows([tr for _, tr in masks])
        rows = flex_rows(rows, Tp) if flex else rows
    else:
        rows = [None] * steps
    loss = hidden.new_zeros((), dtype=torch.float32)
    step_loss, correct, counted, trained = [], [], [], []
    for j, at in enumerate(rows):
        n = 1 + j
        g = slice(None) if at is None else at.clamp(max=Tp - 1)  # the positions computed (padding: any)
        hidden = _rows_at(hidden, rows[j - 1] if j else None, at, dim=1)  # (B, N, H) step j-1's, same t
        emb = F.embedding(shift_left(ids, n, 0)[:, g], embed)  # (B, N, H) token x_{t+1+j}
        att.at = at
        out = draft.layer(emb, hidden, (positions + j)[:, g], att.attend)  # (B, N, H) pre-norm
        c, tr = masks[j]
        if score0 is not None and j == 0:  # step 0 scored at its trained rows only (static: a fixed count)
            ce, hits = _step_ce(draft, out.index_select(1, score0.clamp(max=Tp - 1)), soft, tr, n, score0, dense=True)
        else:
            ce, hits = _step_ce(draft, out, soft, tr, n, at, dense=static)
        w = tr.sum()
        loss_j = ce / w.clamp(min=1).float()
        loss = loss + decay**j * loss_j
        step_loss.append(loss_j.detach())
        correct.append(hits)
        counted.append(c.sum())
        trained.append(w)
        hidden = out
    return TTTResult(loss, torch.stack(step_loss), torch.stack(correct), torch.stack(counted), torch.stack(trained))


def compile_draft(draft: Eagle3Draft, whole_layer: bool = True, mode: str | None = None) -> None:
    """torch.compile the draft in place (parameter names unchanged): the decoder layer including its attention
    (flex_attention traced into the graph) and the final norm, or without ``whole_layer`` only the norms and the
    MLP. A no-op off CUDA. (H200, SmolLM2 shapes, 16k tokens: the whole layer was the faster of the two.)
    ``mode``: torch.compile's mode; "reduce-overhead" replays the graphs as CUDA graphs (Inductor's CUDA graph
    trees; the caller marks each training step with ``torch.compiler.cudagraph_mark_step_begin()``), measured only
    by benchmarks/train_step.py's ``-cg`` rows; train_drafter compiles with the default (None)."""
    if not torch.cuda.is_available():
        return
    # Rows have one shape (pad_batch) and steps ≥ 1 one of BUCKETS query lengths (flex_rows), so the static graphs
    # are few: one per TTT step, later steps' length and grad mode, ≤ 2·(1 + BUCKETS·15) = 242 at ttt_steps'
    # maximum of 16 (a run meets two or three lengths). Dynamo's default limit of 8 would send later steps to eager.
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 256)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 512)  # the layer's and the norm's
    parts = [draft.midlayer, draft.norm] if whole_layer else [
        draft.midlayer.hidden_norm, draft.midlayer.input_layernorm, draft.midlayer.post_attention_layernorm,
        draft.midlayer.mlp, draft.norm]
    # static shapes: dynamo's automatic dynamic ones would give flex a symbolic query length, which Inductor's CPU
    # flex kernel failed to compile (torch 2.13); CUDA's was not tried
    for m in parts:
        m.compile(dynamic=False, mode=mode)
    draft.mask_buffers = {} if mode == "reduce-overhead" else None  # CUDA graphs: masks at fixed addresses


class TTTUnroll(torch.nn.Module):
    """The draft + frozen embeddings as one module whose forward is the unroll (what DDP wraps)."""

    def __init__(self, draft: Eagle3Draft, embed: torch.Tensor, steps: int, decay: float, fast: bool = False):
        super().__init__()
        self.draft = draft
        self.register_buffer("embed", embed, persistent=False)  # (V, H), frozen
        self.steps, self.decay, self.fast = steps, decay, fast

    def forward(self, batch: Batch, soft: SoftTargets) -> TTTResult:
        return ttt_unroll(self.draft, self.embed, batch, soft, self.steps, self.decay, self.fast)


def tau_sim(acc: list[float]) -> float:
    """Simulated acceptance length 1 + Σ_k Π_{i≤k} acc_i (the bonus token plus expected accepted drafts)."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
