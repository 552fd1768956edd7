"""What the TTT unroll reads (:class:`Batch`: samples packed on the token axis) and returns (:class:`TTTResult`).

Notation of the package: B rows, T positions a row, L captured target layers, Ht the target's hidden size, H the
draft's, Vd the draft vocabulary, S the number of TTT steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import register_dataclass


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

    def to(self, device) -> Batch:
        return Batch(**{k: None if v is None else v.to(device) for k, v in vars(self).items()})


@dataclass
class TTTResult:
    """The weighted loss of the S unrolled steps and each step's loss and counts (:mod:`.loss` defines them)."""

    loss: torch.Tensor  # scalar, Σ_j decay^j · loss_j (differentiable)
    step_loss: torch.Tensor  # (S,) detached mean CE per step
    correct: torch.Tensor  # (S,) int64 counted positions where draft argmax == target argmax
    counted: torch.Tensor  # (S,) int64 counted positions
    trained: torch.Tensor  # (S,) int64 positions that enter the loss (top-1 in vocabulary)


# A pytree node, so that module hooks find the loss inside the result: FSDP2 before torch 2.13 walks a forward's
# output with tree_flatten and, finding no tensor in an unregistered dataclass, registers no pre-backward hook;
# its gradients then reach the sharded parameters one optimizer step late
# (torch/distributed/fsdp/_fully_shard/_fsdp_state.py, _register_pre_backward_hook).
register_dataclass(TTTResult)
