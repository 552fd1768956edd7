"""validate_offsets' logic: does the serving engine, given the ids our export writes, feed the stored tensors?

For each stored aux layer h[k] with exported engine id e (``convention.engine_ids``), the engine captures ids
``e + d`` for d in [-search, +search]. Under the translator's rule, id ``e + d`` is boundary ``k + d``; so if
the stored h[k] matches best at d ≠ 0, the engine's real mapping differs from the translator's by
``offset = -d``: given the exported id e it feeds h[k + offset]. Symbolically (translator off by +1)::

    exported id        14        the translator believes: h[15]
    engine feeds       h[16]     (SGLang-style "output of layer i")
    stored h[15] best matches the capture of id 13 (d = -1)  →  offset +1, "one layer deeper"

Comparison per (stored layer, d): mean over tokens of the cosine between stored and captured vectors, and
relative L2 ``‖captured − stored‖ / ‖stored‖`` over all tokens. Adjacent boundaries of a residual stream are
similar (cosine often 0.9+), so a clean match means cosine ≥ ``min_cosine`` (default 0.999) at d = 0.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import torch

from . import convention
from .errors import CaptureMismatch, ConventionError
from .features import FeatureSample

log = logging.getLogger(__name__)


@dataclass
class LayerReport:
    """One stored layer: its exported id, the match at d = 0 and the best match within the search window."""

    boundary: int  # k of the stored h[k]
    engine_id: int  # the id the export writes for it
    cosine: float  # at d = 0
    rel_l2: float  # at d = 0
    best_offset: int  # the engine feeds h[boundary + best_offset] for engine_id
    best_cosine: float
    cosines: dict[int, float] = field(default_factory=dict)  # d → cosine (d = id shift searched)


@dataclass
class OffsetReport:
    engine: str
    engine_version: str | None
    family: str
    samples: int
    tokens: int
    min_cosine: float
    layers: list[LayerReport]

    @property
    def ok(self) -> bool:
        return all(r.best_offset == 0 and r.cosine >= self.min_cosine for r in self.layers)

    def table(self) -> list[dict]:
        """Rows for the heatmap: stored boundary × the boundary each searched id means under the translator."""
        return [
            {"stored": f"h[{r.boundary}]", "engine": r.boundary + d, "offset": d, "cosine": round(c, 6)}
            for r in self.layers for d, c in sorted(r.cosines.items())
        ]

    def to_json(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        for r in d["layers"]:
            r["cosines"] = {str(k): v for k, v in r["cosines"].items()}
        return d

    @property
    def verdict(self) -> str:
        """"ok", "offset" (some layer is best matched at another id) or "numerics" (right id, low cosine)."""
        if any(r.best_offset != 0 for r in self.layers):
            return "offset"
        return "ok" if self.ok else "numerics"

    def compact(self) -> dict:
        """The gate's figures for ``dvc exp show``: verdict, worst cosine at offset 0, best offset per layer."""
        return {"engine": self.engine, "verdict": self.verdict,
                "min_cosine_at_0": round(min(r.cosine for r in self.layers), 6),
                "offset": {f"h{r.boundary}": r.best_offset for r in self.layers}}

    def message(self) -> str:
        """An actionable explanation of every problem (empty when ok)."""
        lines = []
        where = f"{self.engine} {self.engine_version or '?'} / {self.family}"
        for r in self.layers:
            if r.best_offset != 0:
                depth = "deeper" if r.best_offset > 0 else "shallower"
                n = abs(r.best_offset)
                lines.append(
                    f"stored h[{r.boundary}] matches the engine's capture at id {r.engine_id - r.best_offset} "
                    f"(cosine {r.best_cosine:.4f}), not at the exported id {r.engine_id} (cosine {r.cosine:.4f}): "
                    f"given id {r.engine_id} the engine feeds h[{r.boundary + r.best_offset}], "
                    f"{n} layer{'s' if n > 1 else ''} {depth} than eaglepipe/convention.py assumes for {where} "
                    f"(off by {r.best_offset:+d}). A draft exported this way would accept almost nothing: fix "
                    f"the rule for this engine/family/version in eaglepipe/convention.py."
                )
            elif r.cosine < self.min_cosine:
                lines.append(
                    f"stored h[{r.boundary}] is best matched at the right id {r.engine_id}, but only with cosine "
                    f"{r.cosine:.4f} < {self.min_cosine} (relative L2 {r.rel_l2:.3g}): a numerics gap, not an "
                    f"offset — the engine computes this layer differently (kernels, dtype, quantization path) "
                    f"from extract's engine. Extract with the serving engine, or lower validate.min_cosine "
                    f"knowingly."
                )
        return "\n".join(lines)


def _cos_rel(stored: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """stored, got: float32 (T, H). Mean per-token cosine, and ‖got − stored‖ / ‖stored‖."""
    cos = torch.nn.functional.cosine_similarity(stored, got, dim=-1).mean().item()
    rel = ((got - stored).norm() / stored.norm().clamp_min(1e-12)).item()
    return cos, rel


def check_offsets(
    engine, family: str, n_layers: int, layers: list[int], samples: list[FeatureSample],
    search: int, min_cosine: float,
) -> OffsetReport:
    """Capture ``samples`` through ``engine`` with the exported ids (± search) and compare to the stored aux.

    Args:
        engine: a started :class:`eaglepipe.engines.base.Engine`.
        family: the target's model family (``convention.family_of``).
        layers: the stored boundaries (the manifest's ``layers``).
        samples: stored samples; their ``aux`` is (T, L, H).
    Raises:
        ConventionError: the layers cannot be expressed for this engine.
    """
    ids = convention.engine_ids(engine.name, family, layers, n_layers)
    can = set(convention.capturable(engine.name, family, n_layers))
    valid = set()
    for x in range(0, n_layers + 1):  # every engine's ids lie in [0, N]; keep those naming a capturable h[k]
        try:
            if convention.boundaries_of(engine.name, family, [x], n_layers)[0] in can:
                valid.add(x)
        except ConventionError:
            pass
    if not set(ids) <= valid:
        raise CaptureMismatch(
            f"the export would write ids {ids} for boundaries {layers}, but {engine.name} captures only ids "
            f"{sorted(valid)} for {family} with N = {n_layers}: {sorted(set(ids) - valid)} name no capturable layer"
        )
    union = sorted({e + d for e in ids for d in range(-search, search + 1)} & valid)
    caps = engine.capture([s.input_ids.tolist() for s in samples], union)  # per sample (T, len(union), H)
    stored = torch.cat([s.aux.float() for s in samples])  # (ΣT, L, H)
    got = torch.cat(caps)  # (ΣT, len(union), H)
    col = {x: i for i, x in enumerate(union)}
    reports = []
    for j, (k, e) in enumerate(zip(layers, ids)):
        cosines, rels = {}, {}
        for d in range(-search, search + 1):
            if e + d in col:
                cosines[d], rels[d] = _cos_rel(stored[:, j], got[:, col[e + d]])
        best_d = max(cosines, key=lambda d: (round(cosines[d], 6), -abs(d)))  # tie → the smaller shift
        reports.append(LayerReport(k, e, cosines[0], rels[0], -best_d, cosines[best_d], cosines))
    rep = OffsetReport(engine.name, engine.version, family, len(samples), int(stored.shape[0]), min_cosine, reports)
    for r in reports:
        log.info("h[%d] id %d: cosine %.6f rel %.3g best offset %+d", r.boundary, r.engine_id, r.cosine, r.rel_l2,
                 r.best_offset)
    return rep


def require_ok(rep: OffsetReport) -> None:
    """Raise CaptureMismatch with the report's message unless every layer matches at offset 0."""
    if not rep.ok:
        raise CaptureMismatch(f"validate_offsets failed against {rep.engine}:\n{rep.message()}")
