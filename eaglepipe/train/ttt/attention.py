"""The attention of the unrolled steps (:mod:`.masks`' mask), in two implementations, and how the fast one compiles.

Each is an ``attend(q, k, v)`` for the draft's decoder layer, called once per step in order; it keeps every
step's keys and values. q (B, nh, n, hd), k and v (B, nkv, n, hd) → (B, nh, n, hd) in q's dtype.

- :class:`TTTAttention` (plain): only the step-0 block is a T×T product; the later blocks are diagonals computed
  as dot products, so memory is O(T²) for any number of steps.
- :class:`FlexTTTAttention` (fast, CUDA with head_dim >= 16: :func:`uses_flex`): flex_attention over
  [step 0 | … | step j] keys with a block-sparse mask, never a T×T tensor.

:func:`compile_draft` compiles the draft layer (flex_attention traced into it); under CUDA graphs the mask's
tensors are kept at fixed addresses (:func:`fixed_address`).
"""

from __future__ import annotations

import torch

from eaglepipe.model.draft import Eagle3Draft, repeat_kv
from eaglepipe.train.ttt.masks import BLOCK, sample_starts, step0_mask, ttt_block_mask, ttt_mask_mod
from eaglepipe.train.ttt.rows import rows_at

# flex_attention's Triton kernel needs head_dim >= 16 (torch/_inductor/kernel/flex/flex_attention.py, "NYI:
# embedding dimension ... must be at least 16", torch 2.11): below it the plain attention
FLEX_MIN_HEAD_DIM = 16


class TTTAttention:
    """The ``attend`` of the unrolled steps: call once per step, in order; remembers each step's keys/values.

    ``at``, set before a step: the positions (n,) int64, ascending, that the step's queries are at (B = 1), or
    None for all T. Step 0 is always at all T (its keys are every later step's context); a later step may be at
    a subset of the previous step's positions (:func:`~.rows.chain_rows`), its diagonal keys picked to match.
    Padding entries T at the end (:func:`~.rows.static_rows`) attend as position T-1; their outputs are never
    scored."""

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
        ks = [rows_at(ki, ri, r) for ki, ri in zip(self.ks[1:], self.rows[1:])]  # (B, nkv, n, hd) each
        vs = [rows_at(vi, ri, r) for vi, ri in zip(self.vs[1:], self.rows[1:])]
        diag = [(q * repeat_kv(ki, n_rep)).sum(-1, keepdim=True) * scale for ki in ks]  # (B, nh, n, 1) each
        p = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)  # (B, nh, n, T+j)
        y = p[..., :T] @ v0  # (B, nh, n, hd)
        for i, vi in enumerate(vs):
            y = y + p[..., T + i : T + i + 1] * repeat_kv(vi, n_rep)  # (B, nh, n, hd)
        return y


def uses_flex(head_dim: int, device: torch.device | str) -> bool:
    """Whether :func:`~.unroll.ttt_unroll_fast` attends through :class:`FlexTTTAttention` (padded rows) for a
    draft of ``head_dim`` on ``device``: on CUDA with head_dim >= FLEX_MIN_HEAD_DIM; else the plain
    :class:`TTTAttention` (flex_attention has no fast CPU kernel, and Inductor's has no kernel for smaller heads)."""
    return torch.device(device).type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM


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
    step's (N,) has N % BLOCK == 0 and ends in padding entries T (:func:`~.rows.flex_rows`). Keys are
    [step 0 (T) | step 1 (N_1) | … | step j (N_j)]; a query block sees the step-0 blocks of its samples' causal
    past and the blocks of each later step that hold its positions, so step j ≥ 1 costs about
    N_j · (its samples' step-0 span + j·BLOCK) per head. ``buffers``: not None keeps the mask's tensors at fixed
    addresses (:func:`fixed_address`). Raises AssertionError when T % BLOCK != 0."""

    def __init__(self, doc: torch.Tensor, buffers: dict | None = None):
        _, T = doc.shape
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
        if self.buffers is not None:  # the block tables too (fixed_address says why)
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
        return flex_attention_fn()(q, K, V, block_mask=bm, enable_gqa=q.shape[1] != k.shape[1])  # (B, nh, N_j, hd)


def fixed_address(buffers: dict, key: tuple, x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a tensor kept in ``buffers`` under (key, shape, dtype, device): the same storage on every
    call with that key, ``x`` copied in (the first call keeps a clone).

    Why: Inductor's CUDA graph trees take the tensors a mask_mod closes over as static inputs and record the graph
    again whenever one's address changes (torch/_inductor/cudagraph_trees.py, "static input data pointer
    changed"). With only the mask_mod's tensors fixed, two other inputs of flex_attention still move, which two
    is not known; :class:`FlexTTTAttention` keeps the block tables fixed as well.
    Key by TTT step: a step's tensors must survive until its backward, so steps of one training step never share
    one."""
    k = (key, tuple(x.shape), x.dtype, x.device)
    buf = buffers.get(k)
    if buf is None:
        buffers[k] = buf = x.clone()
    else:
        buf.copy_(x)
    return buf


def compile_draft(draft: Eagle3Draft, whole_layer: bool = True, mode: str | None = None) -> None:
    """torch.compile the draft in place (parameter names unchanged): the decoder layer including its attention
    (flex_attention traced into the graph) and the final norm, or without ``whole_layer`` only the norms and the
    MLP. A no-op off CUDA. ``mode``: torch.compile's mode; "reduce-overhead" replays the graphs as CUDA graphs
    (Inductor's CUDA graph trees; the caller marks each training step with
    ``torch.compiler.cudagraph_mark_step_begin()``; used by benchmarks/train_step.py's ``-cg`` rows) and keeps
    the masks at fixed addresses (``draft.mask_buffers``); train_drafter compiles with the default (None)."""
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
