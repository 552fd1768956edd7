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
lm_head product, the fp32 softmax one chunk of tokens at a time, the soft targets read through slices instead of
shifted copies; every position of every step). Both give the same loss and gradients: tests/test_ttt.py
compares them on CPU in fp32 (there the fast path keeps the plain attention: flex_attention has no CPU
backward); on the H200 under bf16 autocast they agreed to 2e-7 in the loss and within 1 % in each gradient's
norm, bf16 rounding (benchmarks/h200/train_step_checks.json).

Loss of step j: soft cross-entropy −Σ_v p_{t+1+j}(v) log q(v) over the draft vocabulary, averaged over the
counted positions whose target top-1 is in the draft vocabulary (target_head.py), weighted step_decay**j.
Accuracy of step j: draft argmax == target argmax (draft-vocab space) over ALL counted positions (an
out-of-vocabulary top-1 counts as a miss). τ_sim = 1 + Σ_k Π_{i≤k} acc_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .draft import Eagle3Draft, repeat_kv
from .target_head import SoftTargets


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
    a subset of the previous step's positions (:func:`chain_rows`), its diagonal keys picked to match."""

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
        s0 = s0.masked_fill(~(self.mask0 if r is None else self.mask0[:, :, r]), float("-inf"))
        ks = [_rows_at(ki, ri, r) for ki, ri in zip(self.ks[1:], self.rows[1:])]  # (B, nkv, n, hd) each
        vs = [_rows_at(vi, ri, r) for vi, ri in zip(self.vs[1:], self.rows[1:])]
        diag = [(q * repeat_kv(ki, n_rep)).sum(-1, keepdim=True) * scale for ki in ks]  # (B, nh, n, 1) each
        p = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)  # (B, nh, n, T+j)
        y = p[..., :T] @ v0  # (B, nh, n, hd)
        for i, vi in enumerate(vs):
            y = y + p[..., T + i : T + i + 1] * repeat_kv(vi, n_rep)  # (B, nh, n, hd)
        return y


def _rows_at(x: torch.Tensor, have: torch.Tensor | None, want: torch.Tensor | None) -> torch.Tensor:
    """x (B, h, n_have, d) at positions ``have`` (None: all) → its rows at ``want`` ⊆ have (None: all; then have
    is None too)."""
    if want is None or (have is not None and have.shape == want.shape):  # nested sets: equal size = equal sets
        return x
    return x[:, :, want if have is None else torch.searchsorted(have, want)]


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


def ttt_mask_mod(doc: torch.Tensor):
    """flex_attention mask_mod of the TTT mask over keys [step 0 | step 1 | …] for doc (B, T):
    key kv (step kv // T, position s = kv % T) is visible to query t iff (kv ≤ t and same sample) or s == t."""
    T = doc.shape[1]

    def mask_mod(b, h, q, kv):
        s = kv % T
        return ((kv <= q) & (doc[b, q] == doc[b, s])) | (s == q)

    return mask_mod


def extend_block_mask(bm, mask_mod, T: int):
    """BlockMask over keys [step 0 | … | step i] → the same plus step i+1's keys, which only the diagonal sees
    (one partial block per query block: block qb of step i+1 is key block n_kv + qb). T % BLOCK == 0."""
    from torch.nn.attention.flex_attention import BlockMask

    kv_num, kv_idx = bm.kv_num_blocks, bm.kv_indices  # (B, 1, nq), (B, 1, nq, n_kv)
    B, H, nq, n_kv = kv_idx.shape
    kv_idx = torch.cat([kv_idx, kv_idx.new_zeros(B, H, nq, nq)], dim=-1)  # (B, 1, nq, n_kv + nq)
    new = torch.arange(n_kv, n_kv + nq, dtype=kv_idx.dtype, device=kv_idx.device).view(1, 1, nq, 1)
    kv_idx.scatter_(-1, kv_num.long().unsqueeze(-1), new.expand(B, H, nq, 1))
    full = bm.full_kv_indices
    if full is not None:
        full = torch.cat([full, full.new_zeros(B, H, nq, nq)], dim=-1)
    return BlockMask.from_kv_blocks(kv_num + 1, kv_idx, bm.full_kv_num_blocks, full, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(T, T + n_kv * BLOCK))


_flex = None


def flex_attention_fn():
    """flex_attention, compiled once per process on CUDA (eager flex is a dense reference implementation)."""
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex = torch.compile(flex_attention) if torch.cuda.is_available() else flex_attention
    return _flex


class FlexTTTAttention:
    """The ``attend`` of the unrolled steps through flex_attention (same mask as :class:`TTTAttention`).

    doc: (B, T) with T % BLOCK == 0. Step j's query block sees the step-0 blocks of its samples' causal past and
    one diagonal block per later step, so the work is the step-0 attention plus j·T·BLOCK per head."""

    def __init__(self, doc: torch.Tensor):
        from torch.nn.attention.flex_attention import create_block_mask

        B, T = doc.shape
        assert T % BLOCK == 0, f"FlexTTTAttention needs T % {BLOCK} == 0, got T = {T}"
        self.T, self.mask_mod = T, ttt_mask_mod(doc)
        self.masks = [create_block_mask(self.mask_mod, B, None, T, T, device=doc.device, BLOCK_SIZE=BLOCK)]
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []

    @torch.compiler.disable
    def mask(self, j: int):
        """Block mask of step j (built on first use by extending step j-1's)."""
        while len(self.masks) <= j:
            self.masks.append(extend_block_mask(self.masks[-1], self.mask_mod, self.T))
        return self.masks[j]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.ks.append(k)  # (B, nkv, T, hd)
        self.vs.append(v)
        j = len(self.ks) - 1
        K = torch.cat(self.ks, dim=2) if j else k  # (B, nkv, (j+1)·T, hd)
        V = torch.cat(self.vs, dim=2) if j else v
        return flex_attention_fn()(q, K, V, block_mask=self.mask(j), enable_gqa=q.shape[1] != k.shape[1])


class SoftCE(torch.autograd.Function):
    """Σ_t w_t · (−Σ_v p_tv log softmax(x_t Wᵀ)_v) and argmax_v (x_t Wᵀ), ``chunk`` tokens at a time.

    x (N, H) the normed draft output, W (Vd, H) lm_head, p (N, Vd) soft targets, w (N,) fp32 weights.
    Only the n rows with w > 0 are multiplied (the rest add nothing to the loss or the gradient; their argmax
    is returned as 0): on real data the loss reads assistant tokens only (about a third of the CPU defaults'
    positions). The gradient is computed with the loss (d/dz = w·(softmax(z)·Σp − p)): the softmax runs one
    chunk of logits at a time in fp32, dz is kept in the product dtype (n, Vd), and the two gradient products
    are one GEMM each; backward only scales them. Under autocast the products run in its dtype (as
    ``nn.Linear`` would).
    """

    @staticmethod
    def forward(ctx, x, W, p, w, chunk: int, grad: bool):
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        need_x, need_w = grad and ctx.needs_input_grad[0], grad and ctx.needs_input_grad[1]
        N, idx = x.shape[0], (w > 0).nonzero().squeeze(1)  # (n,) the rows that count
        x, p, w = x[idx], p[idx], w[idx]  # (n, H), (n, Vd), (n,)
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
            gx = x.new_zeros(N, x.shape[1]).index_copy_(0, idx, (dz @ Wd).to(x.dtype)) if need_x else None  # (N, H)
            gW = (dz.T @ xd).float() if need_w else None  # (Vd, H)
        ctx.save_for_backward(gx, gW)
        ctx.w_dtype = W.dtype
        ctx.mark_non_differentiable(arg)
        return loss, arg.new_zeros(N).index_copy_(0, idx, arg)  # (N,)

    @staticmethod
    def backward(ctx, grad_loss, _grad_arg):
        gx, gW = ctx.saved_tensors
        return (None if gx is None else gx * grad_loss.to(gx.dtype),
                None if gW is None else (gW * grad_loss).to(ctx.w_dtype), None, None, None, None)


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


def soft_ce(x: torch.Tensor, W: torch.Tensor, p: torch.Tensor, w: torch.Tensor, chunk: int | None = None):
    """See :class:`SoftCE`; x (..., H), p (..., Vd), w (...) → (Σ w·ce scalar fp32, argmax (...))."""
    lead = x.shape[:-1]
    chunk = chunk or max(256, (1 << 25) // W.shape[0])  # ~32M logits (128 MB fp32) per chunk
    loss, arg = SoftCE.apply(x.reshape(-1, x.shape[-1]), W, p.reshape(-1, p.shape[-1]),
                             w.reshape(-1).float(), chunk, torch.is_grad_enabled())
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
        hidden = _rows_at(hidden[:, None], rows[j - 1] if j else None, r)[:, 0]  # (B, n, H)
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


def ttt_unroll_fast(
    draft: Eagle3Draft, embed: torch.Tensor, batch: Batch, soft: SoftTargets, steps: int, decay: float
) -> TTTResult:
    """:func:`ttt_unroll` computed faster, same results. On CUDA (head_dim >= 16: :func:`uses_flex`) the row is padded
    to a multiple of BLOCK (padding is a sample of its own, never counted) and attention runs through
    :class:`FlexTTTAttention`. Step j's soft targets p_{t+1+j} are the slice p[:, 1+j:] against
    logits[:, :T-1-j]: positions t ≥ T-1-j are never counted (nothing follows them in the row), so they are not
    computed."""
    T = batch.input_ids.shape[1]
    flex = uses_flex(draft.cfg.head_dim, batch.input_ids.device)
    Tp = -(-T // BLOCK) * BLOCK if flex else T
    aux = batch.aux if torch.is_autocast_enabled(batch.aux.device.type) else batch.aux.to(embed.dtype)  # no fp32 copy
    hidden = pad_to(draft.project(aux), Tp, 0.0)  # (B, Tp, H) step-0 hidden: fc(g_t)
    ids, positions = pad_to(batch.input_ids, Tp, 0), pad_to(batch.positions, Tp, 0)  # (B, Tp)
    doc = pad_to(batch.doc, Tp, -1 if T == Tp else int(batch.doc.max()) + 1)  # (B, Tp)
    att = FlexTTTAttention(doc) if flex else TTTAttention(doc)
    loss = hidden.new_zeros((), dtype=torch.float32)
    step_loss, correct, counted, trained = [], [], [], []
    for j in range(steps):
        n = 1 + j
        emb = F.embedding(shift_left(ids, n, 0), embed)  # (B, Tp, H) token x_{t+1+j}
        out = draft.layer(emb, hidden, positions + j, att.attend)  # (B, Tp, H) pre-norm
        c = (shift_left(batch.doc, n, -2) == batch.doc) & shift_left(batch.loss_mask, n, False)  # (B, T) counted
        tr = c & shift_left(soft.top_in_vocab, n, False)  # (B, T) trained
        m = T - n  # positions t < m have a successor x_{t+1+j} in the row
        if m > 0:
            ce, arg = soft_ce(draft.norm(out[:, :m]), draft.lm_head.weight, soft.p[:, n:], tr[:, :m])  # (), (B, m)
            hits = (tr[:, :m] & (arg == soft.top[:, n:])).sum()
        else:
            ce, hits = out.sum() * 0.0, tr.sum()
        w = tr.sum()
        loss_j = ce / w.clamp(min=1).float()
        loss = loss + decay**j * loss_j
        step_loss.append(loss_j.detach())
        correct.append(hits)
        counted.append(c.sum())
        trained.append(w)
        hidden = out
    return TTTResult(loss, torch.stack(step_loss), torch.stack(correct), torch.stack(counted), torch.stack(trained))



def compile_draft(draft: Eagle3Draft, whole_layer: bool = True) -> None:
    """torch.compile the draft in place (parameter names unchanged): the decoder layer including its attention
    (flex_attention traced into the graph) and the final norm, or without ``whole_layer`` only the norms and the
    MLP. A no-op off CUDA. (H200, SmolLM2 shapes, 16k tokens: the whole layer was the faster of the two.)"""
    if not torch.cuda.is_available():
        return
    # Rows have one shape (pad_batch), so the graphs are few: one per TTT step (its key length) and grad mode.
    # Dynamo's default limit of 8 would send TTT 7's later steps to eager, flex_attention unfused.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    parts = [draft.midlayer, draft.norm] if whole_layer else [
        draft.midlayer.hidden_norm, draft.midlayer.input_layernorm, draft.midlayer.post_attention_layernorm,
        draft.midlayer.mlp, draft.norm]
    for m in parts:
        m.compile()


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
