"""This host's GPUs and cores against the parallel layout params.yaml asks for, checked by ``check_params``, the
first stage that runs on the machine, before any engine or model starts.

Each engine process group needs, on a GPU host, one GPU per rank and, on a CPU host, one core per rank:
- extraction (``extract.engine``, and ``extract.regenerate_engine`` when regenerating): the processes and
  devices of its :class:`Layout`;
- the serving engine (``framework``: validate_offsets, serve_eval) runs one replica of ``tensor_parallel_size``;
- training runs ``train.nproc_per_node`` ranks (eaglepipe/train/distributed.py).
vLLM's and SGLang's CPU backends bind a core group per tensor-parallel rank (eaglepipe/engines/base.py
``cpu_groups``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from eaglepipe.errors import ParamsError


@dataclass(frozen=True)
class Layout:
    """How extraction maps onto torchrun processes on one host.

    procs: processes per host (torchrun's ``--nproc_per_node`` when the stage re-launches itself);
    devices: GPUs (or core groups) each process is given; tp: processes that form one engine replica (1, except
    the hf engine at tensor_parallel_size T > 1: T processes of one GPU each, transformers' own tensor parallelism).
    """

    procs: int
    devices: int
    tp: int = 1

    @classmethod
    def of(cls, engine: str, nproc_per_node: int, tensor_parallel_size: int) -> Layout:
        """vllm / sglang: ``nproc_per_node`` replicas of ``tensor_parallel_size`` GPUs each (the engine starts its own
        tensor-parallel workers). hf at T > 1: T processes, one GPU each, one replica (params refuse
        ``nproc_per_node`` > 1 with it)."""
        if engine == "hf" and tensor_parallel_size > 1:
            return cls(tensor_parallel_size, 1, tensor_parallel_size)
        return cls(nproc_per_node, tensor_parallel_size)


def visible_gpus(env: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs this process may use, without starting CUDA (after which CUDA_VISIBLE_DEVICES would be ignored):
    CUDA_VISIBLE_DEVICES's entries when set, else ``nvidia-smi``'s indices, else [] (a host without GPUs)."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True,
                         check=False)
    return out.stdout.split() if out.returncode == 0 else []


def ranks_of(engine: str, nproc_per_node: int, tensor_parallel_size: int) -> tuple[int, str]:
    """(GPUs or cores an extraction with ``engine`` takes on this host, its :class:`Layout`, in words)."""
    lay = Layout.of(engine, nproc_per_node, tensor_parallel_size)
    if lay.tp > 1:
        return lay.procs, f"{lay.tp} tensor-parallel ranks of one hf replica"
    replicas = f"{lay.procs} replica{'s' if lay.procs > 1 else ''}"
    return lay.procs * lay.devices, (f"{replicas} of one rank" if lay.devices == 1 else
                                     f"{replicas} × {lay.devices} tensor-parallel ranks")


def layout_refusal(p, gpus: int, cores: int) -> str | None:
    """Why ``p`` (:class:`eaglepipe.params.Params`) cannot run on a host with ``gpus`` visible GPUs (0: a CPU
    host) and ``cores`` usable cores, naming the user's numbers and a layout that fits; None when it fits."""
    have, unit = (gpus, "GPU") if gpus else (cores, "core")
    x, t = p.extract, p.tensor_parallel_size
    uses = [("extract.engine", x.engine, x.nproc_per_node)]
    if x.regenerate and x.regenerate_engine and x.regenerate_engine != x.engine:
        uses.append(("extract.regenerate_engine", x.regenerate_engine, x.nproc_per_node))
    uses.append(("framework", p.framework, 1))
    for param, engine, n in uses:
        need, what = ranks_of(engine, n, t)
        if need <= have:
            continue
        if engine == "hf" and t > 1:
            fits = [f"tensor_parallel_size: {have}"]
        else:
            fits = [f"tensor_parallel_size: {have // n}"] if t > 1 and have >= n else []
            fits += [f"extract.nproc_per_node: {have // t}"] if n > 1 and have >= t else []
        return (f"{param}: {engine} at tensor_parallel_size {t}"
                + (f" with extract.nproc_per_node {n}" if n > 1 else "")
                + f" runs {what}, one {unit} each: {need} {unit}s, but this host has {have}. "
                + (f"Set {' or '.join(fits)}" if fits else f"Run it on a host with {need} {unit}s") + ".")
    if p.train.nproc_per_node > have:
        return (f"train.nproc_per_node {p.train.nproc_per_node} runs that many training ranks, one {unit} each, but "
                f"this host has {have} {unit}s. Set train.nproc_per_node: {have}.")
    return None


def check_host(p) -> None:
    """Raise ParamsError when this host cannot hold ``p``'s layout (:func:`layout_refusal`)."""
    why = layout_refusal(p, len(visible_gpus()), len(os.sched_getaffinity(0)))
    if why:
        raise ParamsError(why)
