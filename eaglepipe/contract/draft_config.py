"""Where a draft's ``config.json`` keeps its aux-layer ids, per engine: read, written and checked here.

SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` (:data:`NESTED_FIELD`); vLLM's V1 runner reads
the top-level ``eagle_aux_hidden_state_layer_ids`` (:data:`TOP_FIELD`), else the nested one, and its V2 runner
only the top-level one; eaglepipe's own block keeps the trained boundaries (``eaglepipe.aux_boundaries``).
What an id means is :mod:`eaglepipe.contract.convention`'s answer; this module only finds and places them.
"""

from __future__ import annotations

import copy

from eaglepipe.contract import convention
from eaglepipe.errors import ConventionError

NESTED_FIELD = "eagle_config.eagle_aux_hidden_state_layer_ids"
TOP_FIELD = "eagle_aux_hidden_state_layer_ids"
ID_FIELDS = {"sglang": NESTED_FIELD, "vllm": TOP_FIELD, "hf": "eaglepipe.aux_boundaries"}  # where each engine reads



def config_ids(config: dict, engine: str, runner: str | None = None) -> tuple[list[int] | None, str | None]:
    """The ids an engine reads from a draft config dict, and the field they came from (None, None if none).

    vLLM: ``runner`` "v1" (reads top level, then nested) or "v2" (top level only); None requires both to
    agree and raises ConventionError when only the nested field is set. hf reads
    ``eaglepipe.aux_boundaries``.
    """
    nested = config.get("eagle_config")
    nested_ids = nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None
    if engine == "sglang":
        if nested_ids is None:
            return None, None
        if not isinstance(nested_ids, list) or not nested_ids:
            raise ConventionError(f"{NESTED_FIELD} = {nested_ids!r}: SGLang would capture nothing")
        return list(nested_ids), NESTED_FIELD
    if engine == "vllm":
        top = config.get(TOP_FIELD)
        if top and isinstance(top, (list, tuple)):
            return list(top), TOP_FIELD
        if nested_ids and isinstance(nested_ids, (list, tuple)):
            if runner == "v1":
                return list(nested_ids), NESTED_FIELD
            if runner == "v2":
                return None, None
            raise ConventionError(
                f"only the nested {NESTED_FIELD} = {nested_ids} is set: vLLM's V1 runner reads it, the V2 "
                f"runner (default on CUDA) ignores it and uses its default; write {TOP_FIELD} at the top level"
            )
        return None, None
    if engine == "hf":
        block = config.get("eaglepipe") or {}
        b = block.get("aux_boundaries")
        return (list(b), "eaglepipe.aux_boundaries") if b else (None, None)
    raise ConventionError(f"unknown engine {engine!r}; known: {list(convention.ENGINES)}")


def read_draft_boundaries(
    config: dict,
    engine: str,
    family: str,
    n_layers: int,
    version: str | None = None,
    *,
    allow_default: bool = False,
    runner: str | None = None,
) -> list[int]:
    """What ``engine`` will feed a draft with this ``config.json`` dict, as boundaries h[k], ascending.

    Raises ConventionError when the config holds no ids for that engine (engines then silently use their
    default: one public report went from τ 2.77 to 1.036) unless ``allow_default``; and for everything
    :func:`boundaries_of` refuses.
    """
    ids, field = config_ids(config, engine, runner)
    if ids is None:
        if not allow_default:
            raise ConventionError(
                f"draft config has no {ID_FIELDS[engine]}: {engine} silently falls back to its default h[2], h[N//2], "
                f"h[N-3] (one public report went from τ 2.77 to 1.036 this way); write the ids explicitly"
            )
        return convention.default_boundaries(engine, family, n_layers, version)
    return convention.boundaries_of(engine, family, ids, n_layers, version)


def write_draft_ids(
    config: dict, engine: str, family: str, boundaries: list[int], n_layers: int, version: str | None = None
) -> dict:
    """A copy of a draft ``config.json`` dict with the ids in ``engine``'s meaning and place.

    SGLang: nested ``eagle_config.eagle_aux_hidden_state_layer_ids``; vLLM: top-level
    ``eagle_aux_hidden_state_layer_ids`` (both runners read it); hf: no engine field. Always sets
    ``num_aux_hidden_states`` (both engines size fc from it before any id list) and an ``eaglepipe`` block
    stating the boundaries trained on (its other keys kept). Called once per engine on one dict, it serves both.
    Raises ConventionError as :func:`engine_ids`, or when the config already states other boundaries.
    """
    version = convention.resolve_version(engine, version)
    ids = convention.engine_ids(engine, family, boundaries, n_layers, version)
    out = copy.deepcopy(config)
    block = out.get("eaglepipe") or {}
    if block.get("aux_boundaries") not in (None, list(boundaries)):
        raise ConventionError(
            f"draft config already states aux_boundaries {block['aux_boundaries']}, not {list(boundaries)}"
        )
    if engine == "sglang":
        nested = out.get("eagle_config")
        out["eagle_config"] = dict(nested) if isinstance(nested, dict) else {}
        out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        field = NESTED_FIELD
    elif engine == "vllm":
        out[TOP_FIELD] = ids
        field = TOP_FIELD
    else:
        field = None
    out["num_aux_hidden_states"] = len(ids)
    engines = dict(block.get("engines") or {})
    engines[engine] = {"version": version, "ids": ids, "field": field}
    out["eaglepipe"] = {
        **block,
        "aux_boundaries": list(boundaries),
        "convention": convention.CONVENTION,
        "family": family,
        "n_layers": n_layers,
        "engines": engines,
    }
    return out
