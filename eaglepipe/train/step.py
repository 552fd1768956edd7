"""What one optimizer step is made of: the draft's forward on a batch (:class:`DraftStep`), AdamW, and the
warmup + cosine schedule (:func:`lr_factor`).

A micro-batch's forward: the batch to the device (padded to one row length with ``train.fast`` on CUDA, so the
compiled draft and flex attention compile once), the teacher's soft targets over the draft vocabulary from the
target's h[N] (eaglepipe/model/target_head.py), then the TTT unroll (eaglepipe/train/ttt.py) under
:func:`eaglepipe.train.distributed.autocast_for`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from eaglepipe.model.draft import Eagle3Draft
from eaglepipe.model.target_head import soft_targets
from eaglepipe.params import TrainParams
from eaglepipe.train.distributed import autocast_for, shard
from eaglepipe.train.ttt import Batch, TTTResult, TTTUnroll, compile_draft, pad_batch, padded_length


class DraftStep:
    """The draft under training and its forward on one packed batch (B = 1).

    ``head``: the target's head cut to the draft vocabulary's rows (``TargetHead.draft_rows``), on ``device``.
    ``unroll``: draft + the target's frozen embeddings (:class:`TTTUnroll`); ``model``: what training calls.
    With ``world`` > 1 (eaglepipe/train/distributed.py): ``train.parallel`` ddp wraps ``unroll`` in DDP as
    ``model`` (gradients all-reduced) and evaluation calls the bare ``unroll``; fsdp shards ``unroll`` in place
    (FSDP2), so ``model`` is ``unroll`` and both gather the weights on every call (every rank evaluates the
    same rows). With ``train.fast`` the draft's layers are compiled first (:func:`compile_draft`).
    """

    def __init__(self, draft: Eagle3Draft, head, p: TrainParams, device: torch.device, world: int):
        self.draft, self.head, self.device = draft, head, device
        self.fast, self.batch_tokens, self.teacher_precision = p.fast, p.batch_tokens, p.teacher_precision
        self.unroll = TTTUnroll(draft, head.embed, p.ttt_steps, p.step_decay, fast=p.fast).to(device)
        if p.fast:
            compile_draft(draft)
        self.sharded = world > 1 and p.parallel == "fsdp"
        ids = [device.index] if device.type == "cuda" else None
        if self.sharded:
            shard(self.unroll, device, world)
        use_ddp = world > 1 and not self.sharded
        self.model = DDP(self.unroll, device_ids=ids, broadcast_buffers=False) if use_ddp else self.unroll

    def training(self, b: Batch) -> TTTResult:
        """The training forward: soft targets in ``train.teacher_precision``, the DDP-wrapped unroll."""
        return self._forward(b, self.model, self.teacher_precision)

    def evaluation(self, b: Batch) -> TTTResult:
        """The evaluation forward: the fp32 teacher, the unwrapped unroll (no gradient all-reduce)."""
        return self._forward(b, self.unroll, "fp32")

    def _forward(self, b: Batch, module: torch.nn.Module, precision: str) -> TTTResult:
        b = b.to(self.device)
        if self.fast and b.input_ids.is_cuda:  # one row shape: the compiled draft and flex compile once
            b = pad_batch(b, padded_length(self.batch_tokens))
        soft = soft_targets(self.head, b.last, self.draft.t2d, b.top_in_vocab, precision=precision, need=b.loss_mask)
        with autocast_for(self.device):
            return module(b, soft)

    def no_sync(self):
        """For a micro-batch that is not the step's last: gradients accumulate on each rank, unreduced (DDP's
        no_sync; FSDP2's set_requires_gradient_sync(False), unsharded until the step's last micro-batch)."""
        if isinstance(self.model, DDP):
            return self.model.no_sync()
        return _no_gradient_sync(self.unroll) if self.sharded else nullcontext()


@contextmanager
def _no_gradient_sync(module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(draft: Eagle3Draft, p: TrainParams, device: torch.device, total_steps: int):
    """(AdamW over the draft's trainable parameters, betas (0.9, 0.95), fused with train.fast on CUDA;
    its LambdaLR schedule :func:`lr_factor` over ``total_steps``)."""
    opt = torch.optim.AdamW([q for q in draft.parameters() if q.requires_grad], lr=p.lr, weight_decay=p.weight_decay,
                            betas=(0.9, 0.95), fused=p.fast and device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, p.warmup_steps, total_steps))
    return opt, sched
