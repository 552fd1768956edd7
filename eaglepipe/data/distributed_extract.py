"""Extraction as data-parallel engine replicas over GPUs and hosts, launched by torchrun.

Why torchrun and not Ray: a replica here is one process running the stage script itself with its engine
inside it (the hf engine, or vLLM's / SGLang's offline engine, which start their own tensor-parallel workers),
and the shards go to a folder, not through an object store. torchrun ships with torch (nothing new to install
or run: no ``ray start`` on every host, no actors to define), gives each process its RANK / WORLD_SIZE /
LOCAL_RANK on one host (``--standalone``) and across hosts (``--rdzv_backend c10d``) alike, and tears the job down
when a rank dies (``--max-restarts`` starts it again; finished shards are kept). Ray's strengths, dynamic
scheduling and autoscaling, buy little for a static round-robin of shards; vLLM's own Ray backend is for *one*
engine spread over several hosts, and here a replica lives on one host (its GPUs reached without Ray).

Layout, TP × DP = GPUs: a host of G GPUs at ``tensor_parallel_size`` T runs ``nproc_per_node`` = G / T ranks;
local rank l's engine sees GPUs l·T … l·T + T − 1 (``CUDA_VISIBLE_DEVICES``, set before CUDA starts); on a host
without GPUs, rank l runs on its share of the cores. Shard i is extracted by rank i mod WORLD_SIZE
(:meth:`Replica.shards`); each rank writes its finished shards into the run's scratch folder
(``data/.scratch/features/<run key>/``: across hosts a filesystem every host mounts at the same path), one file
each, atomically; rank 0 waits for every rank (:func:`gather_to_rank0`, a gloo collective: the barrier) and then
writes the store (:meth:`eaglepipe.data.features.ShardWriter.finish`). Rank 0 looks a shard of another rank up
only after that barrier, so an NFS client's cache of names it found missing cannot hide one.

The hf engine at ``tensor_parallel_size`` T > 1 is the one exception to "a rank is a replica": transformers shards
the target over torchrun's own ranks (``DistributedConfig(tp_size=T, tp_plan="auto")``, the model family's
``base_model_tp_plan``), so its one replica is T ranks, one GPU (or core share) each, which run every batch in
lockstep; only its rank 0 writes shards (:class:`eaglepipe.host.Layout`, :attr:`Replica.writes`). transformers 5.x builds that
mesh as (pp, fsdp, tp) over the whole world (transformers/distributed/utils.py ``initialize_distributed_mesh``
refuses a world that is not pp × fsdp × tp), with no data-parallel dimension, so several hf replicas at T > 1
(DP × TP) are refused (eaglepipe/params.py, and :meth:`Replica.from_env` under a torchrun of another size).

Contracts:
  - every rank computes the same run key (the same params, code, target and prompts), checked by :func:`agree`
    before any rank writes or clears a scratch folder;
  - any layout (one process, ``extract.workers``, any number of ranks on any number of hosts) writes the same
    shard and manifest bytes: a shard is computed from its own conversations alone, and neither the resume key
    nor the manifest records the layout;
  - a rank killed mid-run leaves its finished shards whole (renamed into place only once written) and at most a
    ``<shard>.tmp``, which is never taken as finished; torchrun then stops the other ranks, and the next run, in
    any layout, redoes only the missing shards.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch

from eaglepipe.errors import ParamsError
from eaglepipe.host import visible_gpus

log = logging.getLogger(__name__)

# How long rank 0 (or any rank) waits for the slowest rank in the final gather. A dead rank is noticed by
# torchrun, which stops the job, not by this timeout; it only bounds a rank that hangs without dying, and must
# exceed the longest rank's share of the extraction (days for a trillion-parameter target).
WAIT_FOR_RANKS = timedelta(days=7)


@dataclass(frozen=True)
class Replica:
    """This process's place among the extraction replicas: torchrun's RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE (ranks on this host); a process started without torchrun is rank 0 of 1. ``tp``: the processes
    of one replica (:class:`eaglepipe.host.Layout`); ranks r·tp … r·tp + tp − 1 are replica r."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    tp: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, tp: int = 1) -> Replica:
        """Alone (no torchrun), rank 0 of 1 whatever ``tp`` (the stage then re-launches itself). Under torchrun,
        raises ParamsError for tp > 1 (the hf engine's tensor parallelism) unless WORLD_SIZE == tp: one hf replica
        spans the whole torchrun world (transformers/distributed/utils.py ``initialize_distributed_mesh``)."""
        world = int(env.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        if tp > 1 and world != tp:
            raise ParamsError(
                f"the hf engine at tensor_parallel_size {tp} runs as exactly {tp} torchrun ranks (one replica: "
                f"transformers 5.x shards the target over the whole world, transformers/distributed/utils.py "
                f"initialize_distributed_mesh), not {world}: launch torchrun with {tp} processes in all, or extract "
                "with engine vllm or sglang for several replicas at tensor_parallel_size > 1")
        return cls(int(env.get("RANK", "0")), world, int(env.get("LOCAL_RANK", "0")),
                   int(env.get("LOCAL_WORLD_SIZE", str(world))), tp)

    @property
    def replicas(self) -> int:
        return self.world // self.tp

    @property
    def writes(self) -> bool:
        """Whether this rank writes its replica's shards (the replica's first rank; every rank when tp = 1)."""
        return self.rank % self.tp == 0

    def shards(self, n: int) -> list[int]:
        """This rank's replica's shards of 0..n-1: shard i is replica i mod replicas' (rank i mod world's when
        tp = 1)."""
        return list(range(self.rank // self.tp, n, self.replicas))

    @property
    def label(self) -> str:
        """Appended to log lines: ' (rank r of w)' under torchrun, '' alone."""
        return f" (rank {self.rank} of {self.world})" if self.world > 1 else ""


ALONE = Replica()


def relaunch(nproc_per_node: int, tensor_parallel_size: int, argv: list[str] | None = None, tp: int = 1) -> NoReturn:
    """Replace this process by ``python -m torch.distributed.run --standalone --nproc_per_node N <argv>``: the
    same script with the same arguments as N ranks on this host. The exit code is torchrun's (non-zero when a
    rank failed; its message is in the rank's output). Raises ParamsError, before launching anything, when this
    host cannot give N replicas ``tensor_parallel_size`` GPUs (or cores) each (:func:`share_of`); ``tp``: the
    ranks that form one replica (:class:`eaglepipe.host.Layout`), named so in that message."""
    share_of(Replica(nproc_per_node - 1, nproc_per_node, nproc_per_node - 1, nproc_per_node, tp), tensor_parallel_size)
    argv = sys.argv if argv is None else argv
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc_per_node),
           *argv]
    log.info("re-launching under torchrun: %s", " ".join(cmd))
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execv(sys.executable, cmd)


def devices_of(replica: Replica, tensor_parallel_size: int, gpus: list[str]) -> list[str]:
    """Local rank l's GPUs: ``gpus[l·T : (l+1)·T]``. Raises ParamsError when the host has fewer than
    LOCAL_WORLD_SIZE × T, naming the ``nproc_per_node`` that fits."""
    t, n = tensor_parallel_size, replica.local_world
    if n * t > len(gpus):
        raise ParamsError(
            f"{n} extraction replicas on this host at tensor_parallel_size {t} need {n * t} GPUs, but "
            f"{len(gpus)} are visible ({','.join(gpus) or 'none'}): run nproc_per_node = {len(gpus) // t} "
            f"(extract.nproc_per_node, or torchrun's --nproc_per_node) = GPUs / tensor_parallel_size")
    return gpus[replica.local_rank * t:(replica.local_rank + 1) * t]


def share_of(replica: Replica, tensor_parallel_size: int) -> tuple[str, list]:
    """("GPUs", its GPU ids) (:func:`devices_of`), or on a host without GPUs ("cores", its equal share of this
    process's cores, at least one per tensor-parallel rank). Raises ParamsError for a layout the host cannot hold."""
    gpus = visible_gpus()
    if gpus:
        return "GPUs", devices_of(replica, tensor_parallel_size, gpus)
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // replica.local_world
    if share < tensor_parallel_size:
        what = (f"{replica.tp} tensor-parallel ranks of one hf replica" if replica.tp > 1 else
                f"{replica.local_world} extraction replicas at tensor_parallel_size {tensor_parallel_size}")
        raise ParamsError(f"{what} on a CPU need a core per tensor-parallel rank; this host gives them {len(cores)} "
                          f"({cores}): set tensor_parallel_size × extract.nproc_per_node ≤ {len(cores)}")
    return "cores", cores[replica.local_rank * share:(replica.local_rank + 1) * share]


def place(replica: Replica, tensor_parallel_size: int, workers: int = 1) -> None:
    """Give this rank its share of the host (:func:`share_of`), before any engine starts; nothing when alone.

    GPUs: CUDA_VISIBLE_DEVICES = its ``tensor_parallel_size`` GPUs; for a rank of an hf tensor-parallel replica
    (``replica.tp`` > 1, one GPU each) the GPUs of its host's ranks instead, since transformers binds each rank to
    cuda:LOCAL_RANK itself (transformers/distributed/utils.py ``initialize_distributed_mesh``). Cores: its affinity
    and torch threads, which the vLLM / SGLang CPU backends then split into one group per tensor-parallel rank (an
    hf rank computes its shard of every layer on them). Raises ParamsError for
    ``extract.workers`` > 1 under torchrun (ranks are the replicas; a rank does not spawn more) and for a layout
    the host cannot hold.
    """
    if replica.world == 1:
        return
    if workers > 1:
        raise ParamsError(f"extract.workers = {workers} under torchrun (WORLD_SIZE {replica.world}): the ranks are "
                          "the replicas; set extract.workers: 1")
    kind, mine = share_of(replica, tensor_parallel_size)
    if kind == "GPUs":
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus()[:replica.local_world] if replica.tp > 1 else mine)
    else:
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))
    what = "replica" if replica.tp == 1 else "tensor-parallel rank of one hf replica"
    log.info("extraction %s%s, local rank %d of %d, pid %d: %s %s", what, replica.label, replica.local_rank,
             replica.local_world, os.getpid(), kind, ",".join(map(str, mine)))


@contextmanager
def process_group(replica: Replica) -> Iterator[None]:
    """The job's gloo process group (torchrun's store at MASTER_ADDR / MASTER_PORT), destroyed on exit; nothing
    when alone. gloo, whatever the device: only small Python objects cross it, never tensors; except for an hf
    tensor-parallel replica (``replica.tp`` > 1) on GPUs, whose layers all-reduce CUDA tensors over this group
    (transformers takes the default group when one exists): "cpu:gloo,cuda:nccl", object collectives staying on
    gloo (torch/distributed/distributed_c10d.py ``_get_object_coll_device``).

    The group's keys live under a prefix of their own per torchrun attempt (TORCHELASTIC_RESTART_COUNT): torchrun
    keeps one store across the restarts of ``--max-restarts``, and without the prefix restarted ranks hung, or
    failed connecting to the killed attempt's address, in gloo's connect (torch 2.13).
    """
    if replica.world == 1:
        yield
        return
    import torch.distributed as dist

    store, rank, world = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"eaglepipe_extract/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    backend = "cpu:gloo,cuda:nccl" if replica.tp > 1 and visible_gpus() else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=WAIT_FOR_RANKS)
    try:
        yield
    finally:
        dist.destroy_process_group()


def gather_to_rank0(replica: Replica, obj: object) -> list | None:
    """Every rank's ``obj`` (picklable) at rank 0, in rank order; None on the other ranks (alone: ``[obj]``).
    Returns on rank 0 only once every rank has called it: the barrier before rank 0 writes the store."""
    if replica.world == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * replica.world if replica.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def agree(replica: Replica, what: str, value: str) -> None:
    """Raise ParamsError on every rank unless every rank holds the same ``value`` (the run key: the same params,
    code, target and prompts on every host; a rank with another key would write, and clear, another scratch)."""
    if replica.world == 1:
        return
    import torch.distributed as dist

    values = [None] * replica.world
    dist.all_gather_object(values, value)
    if len(set(values)) > 1:
        raise ParamsError(f"the extraction ranks disagree on the {what} (by rank: {values}): run every host from "
                          "the same checkout (params.yaml, eaglepipe, target and prompts)")
