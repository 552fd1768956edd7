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

This is speculators' mask (causal ∪ diagonal) and what an engine computes. The original EAGLE-3 / SpecForge
code additionally hides step-0 keys t-j+1..t from step j (SafeAILab/EAGLE#247 asks why); we keep the mask that
matches serving. Only the step-0 block is a T×T product; the later blocks are diagonals, computed as dot
products, so memory stays O(T²) for any number of steps.

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
    """The ``attend`` of the unrolled steps: call once per step, in order; remembers each step's keys/values."""

    def __init__(self, doc: torch.Tensor):
        self.mask0 = step0_mask(doc)  # (B, 1, T, T)
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.ks.append(k)  # (B, nkv, T, hd)
        self.vs.append(v)
        n_rep, T = q.shape[1] // k.shape[1], q.shape[2]
        scale = q.shape[-1] ** -0.5
        k0, v0 = repeat_kv(self.ks[0], n_rep), repeat_kv(self.vs[0], n_rep)  # (B, nh, T, hd)
        s0 = (q @ k0.transpose(-1, -2)) * scale  # (B, nh, T, T)
        s0 = s0.masked_fill(~self.mask0, float("-inf"))
        diag = [(q * repeat_kv(ki, n_rep)).sum(-1, keepdim=True) * scale for ki in self.ks[1:]]  # (B, nh, T, 1) each
        p = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)  # (B, nh, T, T+j)
        y = p[..., :T] @ v0  # (B, nh, T, hd)
        for i, vi in enumerate(self.vs[1:]):
            y = y + p[..., T + i : T + i + 1] * repeat_kv(vi, n_rep)  # (B, nh, T, hd)
        return y


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
    """Shift the data for TTT step j (see the module docstring's table)."""
    n = 1 + j
    counted = (shift_left(batch.doc, n, -2) == batch.doc) & shift_left(batch.loss_mask, n, False)  # (B, T)
    return StepInputs(
        ids=shift_left(batch.input_ids, n, 0),  # (B, T)
        positions=batch.positions + j,  # (B, T)
        p=shift_left(soft.p, n, 0.0),  # (B, T, Vd)
        top=shift_left(soft.top, n, 0),  # (B, T)
        counted=counted,
        trained=counted & shift_left(soft.top_in_vocab, n, False),  # (B, T)
    )


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar, Σ_j decay^j · loss_j (differentiable)
    step_loss: torch.Tensor  # (S,) detached mean CE per step
    correct: torch.Tensor  # (S,) int64 counted positions where draft argmax == target argmax
    counted: torch.Tensor  # (S,) int64 counted positions
    trained: torch.Tensor  # (S,) int64 positions that enter the loss (top-1 in vocabulary)


def ttt_unroll(
    draft: Eagle3Draft, embed: torch.Tensor, batch: Batch, soft: SoftTargets, steps: int, decay: float
) -> TTTResult:
    """Run ``steps`` TTT steps. ``draft`` may be DDP-unwrapped or not (only its submodules are called).

    embed: (V, H) frozen target embeddings. Returns the weighted loss and per-step counts.
    """
    hidden = draft.project(batch.aux.to(embed.dtype))  # (B, T, H) step-0 hidden: fc(g_t)
    att = TTTAttention(batch.doc)
    loss = hidden.new_zeros(())
    step_loss, correct, counted, trained = [], [], [], []
    for j in range(steps):
        s = align_step(batch, soft, j)
        emb = F.embedding(s.ids, embed)  # (B, T, H), no grad into the frozen table
        out = draft.layer(emb, hidden, s.positions, att.attend)  # (B, T, H) pre-norm
        logits = draft.logits(out).float()  # (B, T, Vd)
        ce = -(s.p * torch.log_softmax(logits, dim=-1)).sum(-1)  # (B, T)
        w = s.trained.float()  # (B, T)
        loss_j = (ce * w).sum() / w.sum().clamp(min=1.0)
        loss = loss + decay**j * loss_j
        with torch.no_grad():
            step_loss.append(loss_j.detach())
            correct.append((s.trained & (logits.argmax(-1) == s.top)).sum())  # OOV top-1: a miss
            counted.append(s.counted.sum())
            trained.append(s.trained.sum())
        hidden = out  # the draft's own pre-norm output feeds step j+1
    return TTTResult(loss, torch.stack(step_loss), torch.stack(correct), torch.stack(counted), torch.stack(trained))


class TTTUnroll(torch.nn.Module):
    """The draft + frozen embeddings as one module whose forward is the unroll (what DDP wraps)."""

    def __init__(self, draft: Eagle3Draft, embed: torch.Tensor, steps: int, decay: float):
        super().__init__()
        self.draft = draft
        self.register_buffer("embed", embed, persistent=False)  # (V, H), frozen
        self.steps, self.decay = steps, decay

    def forward(self, batch: Batch, soft: SoftTargets) -> TTTResult:
        return ttt_unroll(self.draft, self.embed, batch, soft, self.steps, self.decay)


def tau_sim(acc: list[float]) -> float:
    """Simulated acceptance length 1 + Σ_k Π_{i≤k} acc_i (the bonus token plus expected accepted drafts)."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
