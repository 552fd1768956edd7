"""Which serving engines can be given a layer list, decided as soon as N and the family are known.

An engine whose id rule cannot express ``layers`` (SGLang's Llama cannot capture h[N]; its DeepSeek heuristic
reads a first id 1 as h[2], so a list starting at h[1] has no encoding) gets no export folder. This module
says so before any compute — at extract start and at validate_offsets — naming the engine, the rule
(:mod:`eaglepipe.contract.convention`, with its engine source) and the nearest layer lists that do work, and export
records it next to the folders it does write.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

from eaglepipe.contract import convention
from eaglepipe.engine_table import SERVING as SERVING_ENGINES
from eaglepipe.errors import ConventionError, ParamsError

SEARCH = 2  # each boundary may move by up to this much in the nearest-list search


@dataclass
class EnginePlan:
    """One serving engine's verdict on a layer list."""

    engine: str
    version: str
    ids: list[int] | None  # the ids its draft config will hold; None = it cannot feed these layers
    reason: str | None = None  # why not (the rule and its engine source)
    nearest: list[list[int]] = field(default_factory=list)  # closest boundary lists it can feed

    def to_json(self) -> dict:
        return asdict(self)

    def message(self, layers: list[int], n_layers: int) -> str:
        near = ", ".join(str(x) for x in self.nearest) or "none within ±%d" % SEARCH
        return (f"{self.engine} {self.version} cannot serve a draft on layers {layers} (N = {n_layers}): "
                f"{self.reason}. Nearest layer lists it can serve: {near}")


def engine_version(engine: str) -> str:
    """The installed version of a serving engine, else the one the translator was verified against."""
    return convention.installed_version(engine) or convention.KNOWN_VERSIONS[engine]


def nearest_expressible(engine: str, family: str, layers: list[int], n_layers: int, version: str,
                        limit: int = 3) -> list[list[int]]:
    """Up to ``limit`` boundary lists of the same length that ``engine`` can feed, closest to ``layers``.

    Closest = smallest total |shift| (each boundary moved by at most :data:`SEARCH`), ties by the list itself.
    """
    found = []
    for shifts in itertools.product(range(-SEARCH, SEARCH + 1), repeat=len(layers)):
        cand = [k + s for k, s in zip(layers, shifts)]
        if cand == list(layers) or cand != sorted(set(cand)) or cand[0] < 0 or cand[-1] > n_layers:
            continue
        try:
            convention.engine_ids(engine, family, cand, n_layers, version)
        except ConventionError:
            continue
        found.append((sum(map(abs, shifts)), cand))
    return [c for _, c in sorted(found)[:limit]]


def plan(family: str, n_layers: int, layers: list[int]) -> dict[str, EnginePlan]:
    """Every serving engine's :class:`EnginePlan` for ``layers`` on a target of this family and N."""
    out = {}
    for engine in SERVING_ENGINES:
        version = engine_version(engine)
        try:
            ids = convention.engine_ids(engine, family, list(layers), n_layers, version)
            out[engine] = EnginePlan(engine, version, ids)
        except ConventionError as e:
            near = nearest_expressible(engine, family, list(layers), n_layers, version, limit=12)
            both = [c for c in near if all(_feeds(o, family, c, n_layers) for o in SERVING_ENGINES)]
            near = (both + [c for c in near if c not in both])[:3]  # lists every engine serves first
            out[engine] = EnginePlan(engine, version, None, str(e), near)
    return out


def _feeds(engine: str, family: str, layers: list[int], n_layers: int) -> bool:
    try:
        convention.engine_ids(engine, family, layers, n_layers, engine_version(engine))
        return True
    except ConventionError:
        return False


def require_servable(framework: str, family: str, n_layers: int, layers: list[int]) -> dict[str, EnginePlan]:
    """:func:`plan`, refusing (ParamsError, exit 2) when the serving ``framework`` engine cannot feed ``layers``.

    ``framework`` "hf" needs no serving engine. The other engine's verdict is returned for export to record.
    """
    plans = plan(family, n_layers, layers)
    served = plans.get(framework)
    if served is not None and served.ids is None:
        raise ParamsError(
            f"params.yaml: layers = {layers} with framework = {framework}: {served.message(layers, n_layers)}; "
            f"change 'layers' (or serve with another framework)"
        )
    return plans
