"""The loss and accuracy of a TTT step, the fused soft cross-entropy of the fast path, and τ_sim.

Loss of step j: soft cross-entropy −Σ_v p_{t+1+j}(v) log q(v) over the draft vocabulary, averaged over the
counted positions whose target top-1 is in the draft vocabulary (the ``trained`` ones, :mod:`.masks`;
target_head.py), weighted step_decay**j. Accuracy of step j: draft argmax == target argmax (draft-vocab space)
over ALL counted positions (an out-of-vocabulary top-1 counts as a miss). τ_sim = 1 + Σ_k Π_{i≤k} acc_i.

The plain unroll (:func:`~.unroll.ttt_unroll`) computes the loss with ``log_softmax``; the fast one
(:func:`~.unroll.ttt_unroll_fast`) through :func:`step_ce` → :func:`soft_ce` → :class:`SoftCE`: the soft
cross-entropy and its gradient computed with the lm_head product, the fp32 softmax one chunk of tokens at a time,
the soft targets read through slices or row indices instead of shifted copies.
"""

from __future__ import annotations

import torch

from eaglepipe.model.draft import Eagle3Draft
from eaglepipe.model.target_head import SoftTargets


class SoftCE(torch.autograd.Function):
    """Σ_t w_t · (−Σ_v p_tv log softmax(x_t Wᵀ)_v) and argmax_v (x_t Wᵀ), ``chunk`` tokens at a time.

    x (N, H) the normed draft output, W (Vd, H) lm_head, p (M, Vd) soft targets, w (N,) fp32 weights, p_rows
    (N,) int64 or None: x's row i is scored against p[p_rows[i]] (None: p[i], M = N).
    Unless ``dense``, only the n rows with w > 0 are multiplied (the rest add nothing to the loss or the gradient;
    their argmax is returned as 0): on real data the loss reads assistant tokens only. ``dense`` multiplies all N
    rows (n = N), so that no shape depends on the data and nothing waits for the device (a CUDA graph's capture:
    :func:`~.rows.static_rows`). The gradient is computed with the loss (d/dz = w·(softmax(z)·Σp − p)): the
    softmax runs one chunk of logits at a time in fp32, dz is kept in the product dtype (n, Vd), and the two
    gradient products are one GEMM each; backward only scales them. Under autocast the products run in its dtype
    (as ``nn.Linear`` would).
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
    zf = z.float()  # (c, Vd) fp32
    logq = torch.log_softmax(zf, dim=-1)  # (c, Vd) fp32
    pf = p.float()  # (c, Vd) fp32
    ce = -(pf * logq).sum(-1)  # (c,)
    g = ((logq.exp() * pf.sum(-1, keepdim=True) - pf) * w[:, None]).to(z.dtype) if grad else None  # (c, Vd)
    return (ce * w).sum(), zf.argmax(-1), g


_soft_ce_compiled = None


def _soft_ce_chunk(z, p, w, grad: bool):
    """:func:`_soft_ce_chunk_impl`, compiled on CUDA (one fused kernel per pass instead of ~8 elementwise ones)."""
    global _soft_ce_compiled
    if not z.is_cuda:
        return _soft_ce_chunk_impl(z, p, w, grad)
    if _soft_ce_compiled is None:
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


def step_ce(draft: Eagle3Draft, out: torch.Tensor, soft: SoftTargets, tr: torch.Tensor, n: int,
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


def tau_sim(acc: list[float]) -> float:
    """Simulated acceptance length 1 + Σ_k Π_{i≤k} acc_i (the bonus token plus expected accepted drafts)."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
