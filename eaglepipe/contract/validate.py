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

Offset or numerics: when the best match is at d = 0 but cosine < ``min_cosine`` (or relative L2 >
``max_rel_l2``), no neighbouring id explains it: the serving engine computes that layer differently from
extract's engine (a quantized target, other kernels or dtype), a "numerics gap, offset 0". With a
:class:`ReferenceCapture` by the same engine unquantized (validate.quantization + validate.reference), each
layer also gets the stored features against that capture and the quantized capture against it: the gap's
size against the engine's own unquantized numerics. A pre-quantized checkpoint (``OffsetReport.checkpoint``) is
compared the same way with its float release (``target.unquantized``) served by the same engine.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import torch

from eaglepipe.contract import convention
from eaglepipe.data.features import FeatureSample
from eaglepipe.errors import CaptureMismatch, ConventionError

log = logging.getLogger(__name__)


@dataclass
class LayerReport:
    """One stored layer: its exported id, the match at d = 0 and the best match within ±search."""

    boundary: int  # k of the stored h[k]
    engine_id: int  # the id the export writes for it
    cosine: float  # at d = 0
    rel_l2: float  # at d = 0
    best_offset: int  # the engine feeds h[boundary + best_offset] for engine_id
    best_cosine: float
    fed: int  # the boundary the engine reads engine_id as (== boundary unless the translator errs)
    cosines: dict[int, float] = field(default_factory=dict)  # d → cosine against the engine's h[fed + d]
    # with a ReferenceCapture (the same engine unquantized), at the exported id:
    ref_cosine: float | None = None  # stored vs the unquantized capture
    ref_rel_l2: float | None = None
    gap_cosine: float | None = None  # the (quantized) capture vs the unquantized capture: the quantization's gap
    gap_rel_l2: float | None = None


@dataclass
class ReferenceCapture:
    """What the serving engine, unquantized, captures at the exported ids: the baseline of a numerics gap."""

    engine: str
    engine_version: str | None
    dtype: str
    caps: list[torch.Tensor]  # per sample float32 (T, L, H), the stored layers' exported ids in order
    what: str = "unquantized"  # what was captured, e.g. "float release (target.unquantized)"


@dataclass
class OffsetReport:
    engine: str
    engine_version: str | None
    family: str
    samples: int
    tokens: int
    min_cosine: float
    layers: list[LayerReport]
    max_rel_l2: float | None = None  # None: relative L2 is reported, not judged
    quantization: str | None = None  # the serving engine's quantization method (None: unquantized)
    engine_dtype: str | None = None
    reference: str | None = None  # what the ref_* / gap_* figures compare against, e.g. "vllm 0.32.0 bfloat16"
    min_match_cosine: float = 0.9  # a layer whose best cosine within ±search is below this matches nothing
    checkpoint: str | None = None  # the scheme a pre-quantized target ships (e.g. "W8A8"), served by its kernels

    def _unmatched(self, r: LayerReport) -> bool:
        return r.best_cosine < self.min_match_cosine

    def _close(self, r: LayerReport) -> bool:
        return r.cosine >= self.min_cosine and (self.max_rel_l2 is None or r.rel_l2 <= self.max_rel_l2)

    @property
    def ok(self) -> bool:
        return all(r.best_offset == 0 and self._close(r) for r in self.layers)

    def table(self) -> list[dict]:
        """Rows for the heatmap: stored boundary × the boundary each searched id means under the translator."""
        return [
            {"stored": f"h[{r.boundary}]", "engine": r.fed + d, "offset": d, "cosine": round(c, 6)}
            for r in self.layers for d, c in sorted(r.cosines.items())
        ]

    def to_json(self) -> dict:
        """The whole report; cosines to 6 decimals (as :meth:`compact` and :meth:`table`), relative L2s to 6
        significant digits: vLLM's CPU capture moves them by an fp32 ulp from run to run (e.g. a
        relative L2 0.0016593665… or 0.0016593668…, a cosine 0.96724319… or 0.96724331…), and the report is a DVC output that must come out byte for byte."""
        d = asdict(self)
        d["ok"] = self.ok
        for r in d["layers"]:
            r["cosines"] = {str(k): round(v, 6) for k, v in r["cosines"].items()}
            for k in ("cosine", "best_cosine", "ref_cosine", "gap_cosine"):
                r[k] = None if r[k] is None else round(r[k], 6)
            for k in ("rel_l2", "ref_rel_l2", "gap_rel_l2"):
                r[k] = None if r[k] is None else float(f"{r[k]:.6g}")
        return d

    @property
    def verdict(self) -> str:
        """"ok", "mismatch" (some layer matches no capture within ±search: best cosine below min_match_cosine),
        "offset" (some layer is best matched at another id) or "numerics" (right id, but cosine below
        min_cosine or relative L2 above max_rel_l2: "numerics gap, offset 0" in :meth:`message`)."""
        if any(self._unmatched(r) for r in self.layers):
            return "mismatch"
        if any(r.best_offset != 0 for r in self.layers):
            return "offset"
        return "ok" if self.ok else "numerics"

    def compact(self) -> dict:
        """The gate's figures for ``dvc exp show``: verdict, worst cosine at offset 0, best offset per layer."""
        out = {"engine": self.engine, "verdict": self.verdict,
               "min_cosine_at_0": round(min(r.cosine for r in self.layers), 6),
               "offset": {f"h{r.boundary}": r.best_offset for r in self.layers}}
        out["max_rel_l2_at_0"] = round(max(r.rel_l2 for r in self.layers), 6)
        if self.quantization is not None:
            out["quantization"] = self.quantization
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint
        gaps = self._gapped()
        if gaps:  # quantized vs unquantized capture, worst layer
            out["min_gap_cosine"] = round(min(r.gap_cosine for r in gaps), 6)
            out["max_gap_rel_l2"] = round(max(r.gap_rel_l2 for r in gaps), 6)
        return out

    def _gapped(self) -> list[LayerReport]:
        """The layers measured against a reference capture (all of them with one, else none)."""
        return [r for r in self.layers if r.gap_cosine is not None]

    def _served(self) -> str:
        return f"{self.engine} ({', '.join(x for x in (self.checkpoint, self.quantization, self.engine_dtype) if x)})"

    def gap_note(self) -> str:
        """With a reference capture: how far the served (quantized) states are from the unquantized ones, worst
        layer, and what that means for a draft trained on either (empty without a reference)."""
        gaps = self._gapped()
        if not gaps:
            return ""
        worst = min(gaps, key=lambda r: r.gap_cosine)
        return (f"numerics gap of the served {self._served()} target against {self.reference}: worst at "
                f"h[{worst.boundary}], cosine {worst.gap_cosine:.6f}, relative L2 {worst.gap_rel_l2:.3g} (the stored "
                f"features against the served capture: cosine {worst.cosine:.6f}, relative L2 {worst.rel_l2:.3g}). A "
                f"draft trained on features of the unquantized model sees this gap when served; one trained on "
                f"features captured as served does not.")

    def message(self) -> str:
        """An actionable explanation of every problem (empty when ok)."""
        lines = []
        where = f"{self.engine} {self.engine_version or '?'} / {self.family}"
        for r in self.layers:
            if self._unmatched(r):
                lines.append(self._mismatch_line(r, where))
            elif r.best_offset != 0:
                depth = "deeper" if r.best_offset > 0 else "shallower"
                n = abs(r.best_offset)
                lines.append(
                    f"stored h[{r.boundary}] matches the engine's capture at id {r.engine_id - r.best_offset} "
                    f"(cosine {r.best_cosine:.4f}), not at the exported id {r.engine_id} (cosine {r.cosine:.4f}): "
                    f"given id {r.engine_id} the engine feeds h[{r.boundary + r.best_offset}], "
                    f"{n} layer{'s' if n > 1 else ''} {depth} than eaglepipe/contract/rules.py assumes for {where} "
                    f"(off by {r.best_offset:+d}). A draft exported this way would accept almost nothing: fix "
                    f"the rule for this engine/family/version in eaglepipe/contract/rules.py."
                )
            elif not self._close(r):
                lines.append(self._numerics_line(r, where))
        return "\n".join(lines)

    def _mismatch_line(self, r: LayerReport, where: str) -> str:
        """One layer that matches no capture within ±search: neither an offset nor a small numerics gap."""
        span = max(map(abs, r.cosines))
        return (f"stored h[{r.boundary}] matches no capture of {where} within ±{span} layers of the exported id "
                f"{r.engine_id}: best cosine {r.best_cosine:.4f} (offset {r.best_offset:+d}), at the exported id "
                f"{r.cosine:.4f} (relative L2 {r.rel_l2:.3g}), below validate.min_match_cosine "
                f"{self.min_match_cosine}. This is no layer offset and no small numerics gap: the engine computes "
                f"another function of these tokens than extract's engine did (another model implementation, "
                f"weights loaded differently, or other tokens). A draft trained on these features would accept "
                f"almost nothing there. Check the target under both engines (e.g. their greedy outputs) and "
                f"extract with the serving engine itself (extract.engine = {self.engine}).")

    def _numerics_line(self, r: LayerReport, where: str) -> str:
        """One layer best matched at d = 0 but not closely: the numerics gap, its size, and the fix."""
        served = self._served()
        why = []
        if r.cosine < self.min_cosine:
            why.append(f"cosine {r.cosine:.6f} < validate.min_cosine {self.min_cosine}")
        if self.max_rel_l2 is not None and r.rel_l2 > self.max_rel_l2:
            why.append(f"relative L2 {r.rel_l2:.3g} > validate.max_rel_l2 {self.max_rel_l2}")
        line = (f"stored h[{r.boundary}]: numerics gap, offset 0 — the {served} capture at the exported id "
                f"{r.engine_id} is the best match within ±{max(map(abs, r.cosines))} layers but only with cosine "
                f"{r.cosine:.6f}, relative L2 {r.rel_l2:.3g} ({'; '.join(why)}): a numerics gap, not an offset "
                f"— {where} computes this layer differently (kernels, dtype, quantization path) from extract's "
                f"engine.")
        if r.gap_cosine is not None:
            cause = "quantization" if self.quantization or self.checkpoint else "serving setting"
            line += (f" Against {self.reference or 'the unquantized engine'}: the stored features "
                     f"match it at cosine {r.ref_cosine:.6f} (relative L2 {r.ref_rel_l2:.3g}), and the "
                     f"{served} capture differs from it by cosine {r.gap_cosine:.6f} (relative L2 "
                     f"{r.gap_rel_l2:.3g}): " + (
                         f"the gap is the {cause}'s."
                         if r.gap_rel_l2 >= 0.5 * r.rel_l2 else
                         "most of the gap is there unquantized too (extract's engine/dtype against this one's)."))
        fix = ", ".join([f"extract.engine = {self.engine}"]
                        + ([f"extract.quantization = {self.quantization}"] if self.quantization else [])
                        + ([f"extract.engine_dtype = {self.engine_dtype}"] if self.engine_dtype else []))
        return line + (f" Fix: extract with the serving engine itself ({fix}) and retrain, or loosen "
                       f"validate.min_cosine / validate.max_rel_l2 knowingly.")


def cosine_rel_l2(stored: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """stored, got: float32 (T, H). Mean per-token cosine, and ‖got − stored‖ / ‖stored‖ (the gate's two
    measures of one layer)."""
    cos = torch.nn.functional.cosine_similarity(stored, got, dim=-1).mean().item()
    rel = ((got - stored).norm() / stored.norm().clamp_min(1e-12)).item()
    return cos, rel


def _neighbour_ids(engine: str, family: str, fed: list[int], can: set[int], search: int,
                   n_layers: int) -> tuple[list[int], list[int]]:
    """One id list whose engine reading covers ``fed`` (what the exported ids make the engine feed) and as
    many of their ±search neighbours as the engine can capture at once; returns (ids, the boundaries they
    read as, ascending). The list comes from the engine's own reading (convention.ids_reading_as), never
    from the export's translator (convention.engine_ids), which is what is under test.

    The neighbours are boundaries h[k + d], not ids e + d: under a list-dependent rule (SGLang DeepSeek's
    first id, srt/models/deepseek_v2.py set_eagle3_layers_to_capture) ids [1, 2, …] all read as h[i+1],
    so an id-wise union would capture other layers than it names (SGLang then reports "captured 4 of 5 aux
    hidden states" for a 6-layer kimi_k2). Boundaries are dropped from the ends until the list is
    expressible (e.g. h[1] there). Raises CaptureMismatch when no list holds every stored boundary.
    """
    want = sorted({k + d for k in fed for d in range(-search, search + 1)} & can)
    for cut in range(len(want)):
        for lo in range(cut + 1):
            sub = want[lo:len(want) - (cut - lo)]
            if not set(fed) <= set(sub):
                continue
            try:
                return convention.ids_reading_as(engine, family, sub, n_layers), sub
            except ConventionError:
                continue
    raise CaptureMismatch(f"{engine} cannot capture the boundaries {fed} of {family} in one list")


def check_offsets(
    engine, family: str, n_layers: int, layers: list[int], samples: list[FeatureSample],
    search: int, min_cosine: float, max_rel_l2: float | None = None, reference: ReferenceCapture | None = None,
    min_match_cosine: float = 0.9,
) -> OffsetReport:
    """Capture ``samples`` through ``engine`` with the exported ids (± search) and compare to the stored aux.

    Args:
        engine: a started :class:`eaglepipe.engines.base.Engine`.
        family: the target's model family (``convention.family_of``).
        layers: the stored boundaries (the manifest's ``layers``).
        samples: stored samples; their ``aux`` is (T, L, H).
        max_rel_l2: fail a layer above this relative L2 at d = 0 too (None: report only).
        min_match_cosine: a layer whose best cosine within ±search is below this matches nothing: no
            offset is named for it (verdict "mismatch").
        reference: the same samples captured by the unquantized engine (:func:`reference_capture`): each
            layer then reports the stored features and the capture against it (``ref_*``, ``gap_*``).
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
    fed = convention.boundaries_of(engine.name, family, ids, n_layers)  # what serving feeds for those ids
    union, got_b = _neighbour_ids(engine.name, family, fed, can, search, n_layers)
    caps = engine.capture([s.input_ids.tolist() for s in samples], union)  # per sample (T, len(union), H)
    stored = torch.cat([s.aux.float() for s in samples])  # (ΣT, L, H)
    got = torch.cat(caps)  # (ΣT, len(union), H)
    col = {b: i for i, b in enumerate(got_b)}  # boundary → column of the capture
    reports = []
    for j, (k, e, f) in enumerate(zip(layers, ids, fed)):
        cosines, rels = {}, {}
        for d in range(-search, search + 1):  # d: the engine's boundary f + d against the stored h[k]
            if f + d in col:
                cosines[d], rels[d] = cosine_rel_l2(stored[:, j], got[:, col[f + d]])
        best_d = max(cosines, key=lambda d: (round(cosines[d], 6), -abs(d)))  # tie → the smaller shift
        reports.append(LayerReport(k, e, cosines[0], rels[0], -best_d, cosines[best_d], f, cosines))
    ref_name = None
    if reference is not None:
        ref = torch.cat(reference.caps)  # (ΣT, L, H)
        if ref.shape != stored.shape:
            raise CaptureMismatch(f"reference capture {tuple(ref.shape)} does not match the stored {tuple(stored.shape)}")
        for j, r in enumerate(reports):
            r.ref_cosine, r.ref_rel_l2 = cosine_rel_l2(stored[:, j], ref[:, j])
            r.gap_cosine, r.gap_rel_l2 = cosine_rel_l2(ref[:, j], got[:, col[fed[j]]])
        ref_name = f"{reference.engine} {reference.engine_version or '?'} {reference.dtype}, {reference.what}"
    rep = OffsetReport(engine.name, engine.version, family, len(samples), int(stored.shape[0]), min_cosine, reports,
                       max_rel_l2, getattr(engine, "quantization", None), getattr(engine, "dtype", None), ref_name,
                       min_match_cosine)
    for r in reports:
        log.info("h[%d] id %d: cosine %.6f rel %.3g best offset %+d", r.boundary, r.engine_id, r.cosine, r.rel_l2,
                 r.best_offset)
    return rep


def reference_capture(engine, family: str, n_layers: int, layers: list[int], samples: list[FeatureSample],
                      what: str = "unquantized") -> ReferenceCapture:
    """``samples`` captured by ``engine`` (the serving engine, unquantized; ``what`` names it in the report) at the
    ids the export writes."""
    assert getattr(engine, "quantization", None) is None, "a reference capture is the unquantized engine's"
    ids = convention.engine_ids(engine.name, family, layers, n_layers)
    caps = engine.capture([s.input_ids.tolist() for s in samples], ids)  # per sample (T, L, H)
    return ReferenceCapture(engine.name, engine.version, engine.dtype, caps, what)


def require_ok(rep: OffsetReport) -> None:
    """Raise CaptureMismatch with the report's message unless every layer matches at offset 0."""
    if not rep.ok:
        raise CaptureMismatch(f"validate_offsets failed against {rep.engine}:\n{rep.message()}")
