"""Processes, devices, precision and RNG state: what differs between one process and a torchrun job.

DDP: under torchrun (WORLD_SIZE > 1) every rank reads all samples and takes every world-th micro-batch, so one
optimizer step of W ranks × grad_accum a equals one process with grad_accum W·a on the same micro-batches.

Precision (:func:`autocast_for`): on CUDA the draft's forward runs under bf16 autocast with fp32 master weights
(the engines serve in bf16); on CPU it runs in fp32, because CPU bf16 autocast is slower than fp32 on CPUs
without AMX and would make the resume and DDP equality tests depend on kernel choice.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    """This process's place in the job (torchrun's RANK, WORLD_SIZE, LOCAL_RANK)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0  # the CUDA device index of this rank

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes checkpoints, curves and the draft."""
        return self.rank == 0


def init_distributed() -> Dist:
    """Join the torchrun process group when WORLD_SIZE > 1 (nccl on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def pick_device(d: Dist) -> torch.device:
    """cuda:<local rank> when CUDA is available (made the current device), else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(d.local_rank)
        return torch.device("cuda", d.local_rank)
    return torch.device("cpu")


def barrier(d: Dist) -> None:
    """Wait for every rank (nothing to wait for in one process)."""
    if d.world > 1:
        dist.barrier()


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA, none on CPU (module docstring: Precision): the draft's compute in training and
    evaluation (and in benchmarks/sim_gap.py, which must evaluate as train does)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def rng_state() -> dict:
    """The global RNG states (torch CPU, Python, every CUDA device) for a checkpoint."""
    s = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    """Restore :func:`rng_state`'s dict (its CUDA states only where CUDA is available)."""
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
