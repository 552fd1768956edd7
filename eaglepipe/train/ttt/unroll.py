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
bug); only the hidden state is the draft's own. The attention of step j sees the keys of steps 0..j
(:mod:`.masks`); the loss and accuracy are :mod:`.loss`'s.

Two implementations of the same unroll: :func:`ttt_unroll` (plain: :class:`~.attention.TTTAttention`, the loss
through ``log_softmax``) and :func:`ttt_unroll_fast` (flex attention on CUDA, :func:`~.loss.soft_ce`, padded
rows). Both give the same loss and gradients: tests/test_ttt.py compares them in fp32 on the CPU (there the fast
path keeps the plain attention, flex_attention having no CPU backward; its forward, the compacted flex path
included, is compared there too) and on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eaglepipe.model.draft import Eagle3Draft
from eaglepipe.model.target_head import SoftTargets
from eaglepipe.train.ttt.attention import FlexTTTAttention, TTTAttention, uses_flex
from eaglepipe.train.ttt.batch import Batch, TTTResult
from eaglepipe.train.ttt.loss import step_ce
from eaglepipe.train.ttt.masks import BLOCK, counted_trained, shift_left
from eaglepipe.train.ttt.rows import chain_rows, flex_rows, pad_to, rows_at


@dataclass
class StepInputs:
    """What step j reads and is scored on, per position t (all (B, T) unless noted)."""

    ids: torch.Tensor  # x_{t+1+j}, teacher-forced token embedded at t
    positions: torch.Tensor  # RoPE position + j
    p: torch.Tensor  # (B, T, Vd) soft target p_{t+1+j}
    top: torch.Tensor  # target argmax (draft id) at t+1+j
    counted: torch.Tensor  # bool: t+1+j in the same sample and loss_mask[t+1+j]
    trained: torch.Tensor  # bool: counted and the target's top-1 is in the draft vocabulary


def align_step(batch: Batch, soft: SoftTargets, j: int) -> StepInputs:
    """Shift the data for TTT step j (the module docstring's table)."""
    n = 1 + j
    counted, trained = counted_trained(batch, soft, j)  # (B, T) bool each
    return StepInputs(
        ids=shift_left(batch.input_ids, n, 0),  # (B, T)
        positions=batch.positions + j,  # (B, T)
        p=shift_left(soft.p, n, 0.0),  # (B, T, Vd)
        top=shift_left(soft.top, n, 0),  # (B, T)
        counted=counted,
        trained=trained,  # (B, T)
    )


def ttt_unroll(
    draft: Eagle3Draft, embed: torch.Tensor, batch: Batch, soft: SoftTargets, steps: int, decay: float,
    fast: bool = False,
) -> TTTResult:
    """Run ``steps`` TTT steps (the reference). ``draft`` may be DDP-unwrapped or not (only its submodules are
    called). embed: (V, H) frozen target embeddings. Returns the weighted loss and per-step counts. ``fast``: run
    :func:`ttt_unroll_fast` instead (same results).

    1. hidden = fc(g_t) at every position t: step 0's hidden state.
    2. The attention (:class:`~.attention.TTTAttention`) and each step's positions rows_j: with one packed row
       (B = 1, as training collates) steps ≥ 1 run only where a later loss reads their chain
       (:func:`~.rows.chain_rows`), the same loss and gradients with less work; else every position.
    3. For each step j:
       a. shift the data (:func:`align_step`): token x_{t+1+j}, RoPE position t+j, masks; taken at rows_j;
       b. hidden at rows_j (step j−1's output at the same t);
       c. the decoder layer on (embed(x_{t+1+j}), hidden), attending to the keys of steps 0..j;
       d. logits at the trained positions, soft CE against p_{t+1+j}, mean over them; loss += decay^j · loss_j;
       e. the counts: correct (draft argmax == target top-1), counted, trained;
       f. hidden = the layer's pre-norm output (norm_output: its norm): the draft's own state feeds step j+1.
    4. The per-step values stacked into a :class:`TTTResult`.
    """
    if fast:
        return ttt_unroll_fast(draft, embed, batch, soft, steps, decay)
    # 1. step 0's hidden state
    hidden = draft.project(batch.aux.to(embed.dtype))  # (B, T, H) fc(g_t)
    # 2. the attention and the positions of each step
    att = TTTAttention(batch.doc)
    one_row = hidden.shape[0] == 1
    rows = chain_rows([counted_trained(batch, soft, j)[1] for j in range(steps)]) if one_row else [None] * steps
    loss = hidden.new_zeros(())  # ()
    step_loss, correct, counted, trained = [], [], [], []
    for j, r in enumerate(rows):  # 3. the steps; r: (n,) int64 or None (all T)
        # 3a. the data of step j, at its positions
        s = align_step(batch, soft, j)
        ids, pos, tr = (s.ids, s.positions, s.trained) if r is None else \
            (s.ids[:, r], s.positions[:, r], s.trained[:, r])  # (B, n) each
        # 3b. step j-1's hidden state at the same positions
        hidden = rows_at(hidden, rows[j - 1] if j else None, r, dim=1)  # (B, n, H)
        # 3c. the decoder layer
        att.at = r
        out = draft.layer(F.embedding(ids, embed), hidden, pos, att.attend)  # (B, n, H) pre-norm; no grad into embed
        # 3d. the loss, where it reads the logits (ascending t, as p's rows)
        logits = draft.logits(out[tr]).float()  # (m, Vd)
        ce = -(s.p[s.trained] * torch.log_softmax(logits, dim=-1)).sum(-1)  # (m,)
        loss_j = ce.sum() / s.trained.sum().clamp(min=1)  # ()
        loss = loss + decay**j * loss_j
        # 3e. the counts
        with torch.no_grad():
            step_loss.append(loss_j.detach())
            correct.append((logits.argmax(-1) == s.top[s.trained]).sum())  # OOV top-1: a miss (not trained)
            counted.append(s.counted.sum())
            trained.append(s.trained.sum())
        # 3f. the draft's own output feeds step j+1
        hidden = draft.feed(out)
    # 4. per step: (S,) each
    return TTTResult(loss, torch.stack(step_loss), torch.stack(correct), torch.stack(counted), torch.stack(trained))


def ttt_unroll_fast(
    draft: Eagle3Draft, embed: torch.Tensor, batch: Batch, soft: SoftTargets, steps: int, decay: float,
    rows: list[torch.Tensor] | None = None,
) -> TTTResult:
    """:func:`ttt_unroll` computed faster, same results. ``rows``: :func:`~.rows.static_rows` of this batch (B = 1,
    T a multiple of BLOCK where flex runs: :func:`~.rows.pad_batch`); then no shape depends on the data and no op
    waits for the device, so the step can be captured as a CUDA graph (:mod:`eaglepipe.train.graphed`).

    1. Pad: on CUDA with head_dim >= 16 (:func:`~.attention.uses_flex`) the row is padded to Tp, a multiple of
       BLOCK (the padding a sample of its own, never counted); else Tp = T. hidden = fc(g_t), step 0's.
    2. The attention: :class:`~.attention.FlexTTTAttention` where flex runs, else
       :class:`~.attention.TTTAttention`; each step's counted and trained masks.
    3. Each step's positions: given ``rows``, step 0 runs at all Tp but is scored at rows[0] only (every row
       multiplied, padding included) and the later steps run at rows[1:]. Else with one row (B = 1) steps ≥ 1 run
       at :func:`~.rows.chain_rows`, padded on the flex path to one of few lengths (:func:`~.rows.flex_rows`); on
       CUDA without flex at every position (the compiled plain attention takes no padding, and exact counts would
       recompile it per row), as with B > 1.
    4. For each step j at its positions:
       a. hidden at them (step j−1's output at the same t); token x_{t+1+j} embedded;
       b. the decoder layer at RoPE positions t+j, attending through 2.'s attention;
       c. Σ w·ce and hits (:func:`~.loss.step_ce`; positions t ≥ T-1-j are never counted at step j, so never
          scored);
       d. loss += decay^j · Σ w·ce / trained; the counts; hidden = the layer's output.
    5. The per-step values stacked into a :class:`TTTResult`.

    Raises ValueError when ``rows`` is given and the row would need padding here."""
    B, T = batch.input_ids.shape
    dev = batch.input_ids.device
    # 1. the padded length, step 0's hidden state and the padded data
    flex = uses_flex(draft.cfg.head_dim, dev)
    Tp = -(-T // BLOCK) * BLOCK if flex else T
    if rows is not None and Tp != T:
        raise ValueError(f"ttt_unroll_fast with rows: the row must be padded to a multiple of {BLOCK} (pad_batch)")
    aux = batch.aux if torch.is_autocast_enabled(dev.type) else batch.aux.to(embed.dtype)  # no fp32 copy
    hidden = pad_to(draft.project(aux), Tp, 0.0)  # (B, Tp, H) fc(g_t)
    ids, positions = pad_to(batch.input_ids, Tp, 0), pad_to(batch.positions, Tp, 0)  # (B, Tp)
    doc = pad_to(batch.doc, Tp, -1 if T == Tp else int(batch.doc.max()) + 1)  # (B, Tp)
    # 2. the attention and the masks
    att = FlexTTTAttention(doc, draft.mask_buffers) if flex else TTTAttention(doc)
    masks = [counted_trained(batch, soft, j) for j in range(steps)]  # (B, T) counted, trained per step
    # 3. the positions of each step
    static, score0 = rows is not None, None
    if static:
        score0, rows = rows[0], [None, *rows[1:]]
    elif B == 1 and (flex or dev.type != "cuda"):
        rows = chain_rows([tr for _, tr in masks])
        rows = flex_rows(rows, Tp) if flex else rows
    else:
        rows = [None] * steps
    loss = hidden.new_zeros((), dtype=torch.float32)  # ()
    step_loss, correct, counted, trained = [], [], [], []
    for j, at in enumerate(rows):  # 4. the steps; at: (N,) int64 or None (all Tp)
        n = 1 + j
        # 4a. step j-1's hidden state and token x_{t+1+j}, at this step's positions
        g = slice(None) if at is None else at.clamp(max=Tp - 1)  # the positions computed (padding: any)
        hidden = rows_at(hidden, rows[j - 1] if j else None, at, dim=1)  # (B, N, H)
        emb = F.embedding(shift_left(ids, n, 0)[:, g], embed)  # (B, N, H)
        # 4b. the decoder layer
        att.at = at
        out = draft.layer(emb, hidden, (positions + j)[:, g], att.attend)  # (B, N, H) pre-norm
        # 4c. the loss's sum and the hits; step 0 under static rows: at its trained positions only (a fixed count)
        c, tr = masks[j]
        if score0 is not None and j == 0:
            ce, hits = step_ce(draft, out.index_select(1, score0.clamp(max=Tp - 1)), soft, tr, n, score0, dense=True)
        else:
            ce, hits = step_ce(draft, out, soft, tr, n, at, dense=static)
        # 4d. the weighted loss, the counts, the next step's hidden state
        w = tr.sum()
        loss_j = ce / w.clamp(min=1).float()  # ()
        loss = loss + decay**j * loss_j
        step_loss.append(loss_j.detach())
        correct.append(hits)
        counted.append(c.sum())
        trained.append(w)
        hidden = draft.feed(out)
    # 5. per step: (S,) each
    return TTTResult(loss, torch.stack(step_loss), torch.stack(correct), torch.stack(counted), torch.stack(trained))


class TTTUnroll(torch.nn.Module):
    """The draft + frozen embeddings as one module whose forward is the unroll (what DDP wraps)."""

    def __init__(self, draft: Eagle3Draft, embed: torch.Tensor, steps: int, decay: float, fast: bool = False):
        super().__init__()
        self.draft = draft
        self.register_buffer("embed", embed, persistent=False)  # (V, H), frozen
        self.steps, self.decay, self.fast = steps, decay, fast

    def forward(self, batch: Batch, soft: SoftTargets) -> TTTResult:
        return ttt_unroll(self.draft, self.embed, batch, soft, self.steps, self.decay, self.fast)
