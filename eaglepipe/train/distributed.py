"""Processes, devices, precision and RNG state: what differs between one process and a torchrun job.

Launch (:func:`launch_ranks`): with ``train.nproc_per_node`` N > 1 the train_drafter stage runs its own command
line again under torchrun (``torch.distributed.run --standalone --nproc_per_node N``), so ``dvc repro`` alone
trains on N processes; nccl on CUDA (one GPU a rank), gloo on CPU.

Data parallel, either way (``train.parallel``): every rank reads all samples and takes every world-th
micro-batch, so one optimizer step of W ranks × grad_accum a equals one process with grad_accum W·a on the same
micro-batches (gradients are averaged over ranks).
- ddp: each rank holds the whole draft and its AdamW state; DDP all-reduces the gradients.
- fsdp: FSDP2 (``torch.distributed.fsdp.fully_shard``, :func:`shard`): every parameter, its gradient and its
  AdamW state are DTensors sharded on dim 0 over the ranks (``torch.chunk``'s split: rank r holds chunk r);
  the draft's forward all-gathers them, its backward reduce-scatters the gradients. Buffers (d2t, t2d, the
  frozen embeddings) are whole on every rank. The draft is one FSDP unit (one decoder layer: nothing to overlap).

Precision (:func:`autocast_for`): on CUDA the draft's forward runs under bf16 autocast with fp32 master weights
(the engines serve in bf16); on CPU it runs in fp32, because CPU bf16 autocast is slower than fp32 on CPUs
without AMX and would make the resume and DDP equality tests depend on kernel choice.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from eaglepipe.errors import ParamsError


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


def launch_ranks(nproc: int) -> int | None:
    """Run this process's command line (``sys.argv``: a script and its arguments) again as ``nproc`` torchrun
    ranks on this host (``--standalone``: a free local port) and wait for them, when ``nproc`` > 1 and this
    process is not already a rank (no WORLD_SIZE in the environment). Returns the job's exit code (0; else the
    first failed rank's, or 1 for a rank killed by a signal; each rank prints its own error), or None when
    there is nothing to launch (the caller does the work itself). Raises ParamsError: more ranks than visible
    CUDA devices."""
    if nproc == 1 or "WORLD_SIZE" in os.environ:
        return None
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ParamsError(f"params.yaml: 'train.nproc_per_node' = {nproc}: only {torch.cuda.device_count()} CUDA "
                          "devices are visible (one rank per GPU)")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(["--standalone", "--nproc_per_node", str(nproc), *sys.argv])
    try:
        run(args)
    except ChildFailedError as e:
        return max(1, e.get_first_failure()[1].exitcode)
    return 0


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


def autocast_for(device: torch.device, cache_enabled: bool = True):
    """bf16 autocast on CUDA, none on CPU (module docstring: Precision): the draft's compute in training and
    evaluation (and in benchmarks/sim_gap.py, which must evaluate as train does). ``cache_enabled`` False inside
    a CUDA graph capture (torch.cuda.make_graphed_callables' rule: cached casts would outlive the capture)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache_enabled)
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


def shard(module: torch.nn.Module, device: torch.device, world: int) -> None:
    """FSDP2 in place: ``module``'s parameters become DTensors sharded on dim 0 over a 1-D mesh of the ``world``
    ranks on ``device``'s type (module docstring). Call after init_distributed, before making the optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=init_device_mesh(device.type, (world,)))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2); any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` (a local shard, as :func:`local` gave it) as a DTensor sharded like ``ref`` when ``ref`` is one,
    on ``ref``'s device; else ``t`` as it is."""
    if not isinstance(ref, DTensor):
        return t
    return DTensor.from_local(t.to(ref.device), ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                              stride=ref.stride())


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (an all-gather: every rank calls it), any other tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t
