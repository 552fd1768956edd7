"""What one optimizer step is made of: the draft's forward on a batch (:class:`DraftStep`), AdamW, and the
warmup + cosine schedule (:func:`lr_factor`).

A micro-batch's forward: the batch to the device (padded to one row length with ``train.fast`` on CUDA, so the
compiled draft and flex attention compile once), the teacher's soft targets over the draft vocabulary from the
target's h[N] (eaglepipe/model/target_head.py), then the TTT unroll (eaglepipe/train/ttt.py) under
:func:`eaglepipe.train.distributed.autocast_for`. With ``train.cuda_graph`` (:func:`graph_refusal` says when it
applies) the whole optimizer step is one CUDA graph per row shape instead (:meth:`DraftStep.use_graph`).
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
from eaglepipe.train.graphed import GraphedStep
from eaglepipe.train.ttt import (
    Batch, TTTResult, TTTUnroll, compile_draft, pad_batch, padded_length, static_rows, ttt_unroll_fast)


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
        self.graph: GraphedStep | None = None  # use_graph
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

    def use_graph(self, opt: torch.optim.Optimizer, grad_clip: float) -> None:
        """From now on train through :meth:`graphed_training`: soft targets (at every position: ``need`` would read
        the mask back), the unroll given :func:`static_rows`, backward, clipping to ``grad_clip`` and ``opt``'s
        step, captured as one CUDA graph per row shape (:class:`GraphedStep`). Call after the optimizer's state is
        final (a resumed checkpoint loaded): the graph records its tensors' addresses. ``opt`` (fused AdamW) is
        made capturable, its ``lr`` a CUDA tensor the schedule fills in place (a float would be frozen at capture),
        and its ``found_inf`` (fused AdamW skips the update where it is 1, as under torch.amp.GradScaler) set in
        the graph when the loss or the gradient norm is not finite; ``grad_norm`` holds the step's norm (a
        0-dim float32 CUDA tensor, before clipping)."""
        params = [q for q in self.draft.parameters() if q.requires_grad]
        for g in opt.param_groups:
            g["lr"], g["capturable"] = torch.tensor(float(g["lr"]), device=self.device), True
        self.grad_norm = torch.zeros((), device=self.device)
        opt.found_inf = torch.zeros((), device=self.device)

        def step(b: Batch, rows: list[torch.Tensor]) -> TTTResult:
            soft = soft_targets(self.head, b.last, self.draft.t2d, b.top_in_vocab, precision=self.teacher_precision)
            with autocast_for(self.device, cache_enabled=False):
                r = ttt_unroll_fast(self.draft, self.unroll.embed, b, soft, self.unroll.steps, self.unroll.decay,
                                    rows=rows)
            r.loss.backward()
            self.grad_norm.copy_(torch.nn.utils.clip_grad_norm_(params, grad_clip))
            opt.found_inf.copy_(~(r.loss.isfinite() & self.grad_norm.isfinite()))
            opt.step()
            return r

        self.graph = GraphedStep(step, params, opt)

    def graphed_training(self, b: Batch) -> TTTResult:
        """One whole optimizer step on ``b`` (grad_accum 1) through the graph of :meth:`use_graph`; the update is
        skipped where the loss or ``grad_norm`` is not finite. The result's tensors are the graph's outputs,
        overwritten by the next call."""
        b = pad_batch(b.to(self.device), padded_length(self.batch_tokens))
        return self.graph(b, static_rows(b, b.top_in_vocab, self.unroll.steps))

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


def graph_refusal(p: TrainParams, device: torch.device, world: int) -> str | None:
    """None where ``train.cuda_graph`` applies (:meth:`DraftStep.use_graph`), else why the eager step runs: the
    graph holds one micro-batch's backward and the optimizer step, so not with grad_accum > 1, and not under
    DDP/FSDP2 (their hooks all-reduce outside any graph)."""
    if not (p.fast and device.type == "cuda"):
        return "train.cuda_graph needs train.fast on CUDA"
    if not p.cuda_graph:
        return "train.cuda_graph is false"
    if p.grad_accum > 1:
        return f"grad_accum {p.grad_accum}: the graph holds one micro-batch and the optimizer step"
    if world > 1:
        return f"{world} ranks: DDP/FSDP2 all-reduce outside the graph"
    return None


def make_optimizer(draft: Eagle3Draft, p: TrainParams, device: torch.device, total_steps: int):
    """(AdamW over the draft's trainable parameters, betas (0.9, 0.95), fused with train.fast on CUDA;
    its LambdaLR schedule :func:`lr_factor` over ``total_steps``)."""
    opt = torch.optim.AdamW([q for q in draft.parameters() if q.requires_grad], lr=p.lr, weight_decay=p.weight_decay,
                            betas=(0.9, 0.95), fused=p.fast and device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, p.warmup_steps, total_steps))
    return opt, sched
