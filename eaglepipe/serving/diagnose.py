"""`eaglepipe diagnose`: the boundaries h[k] a draft was trained on, found by experiment on the target.

A draft folder says which ids to feed, not which states it was trained on (`eaglepipe inspect` reads what each
engine *would* feed). Here the target (transformers, fp32) writes a greedy continuation of each prompt, one forward
over prompt + continuation captures every boundary h[0..N] (:func:`eaglepipe.engines.hf.boundary_hooks`), and the
draft (:func:`eaglepipe.model.draft_folder.load_draft_folder`, any serving format) is scored under each candidate
boundary set by its **acceptance at draft position 1**: over the continuation's positions t, the draft reads
(g_t, x_{t+1}) with g_t taken at the set, and its argmax is accepted when it is the target's top-1 after x_{t+1}
(= x_{t+2} on a greedy continuation) — what a round's first drafted token meets in speculative decoding
(eaglepipe/serving/specdec.py), teacher-forced. Instead of greedy continuations, the conversations' own assistant
turns can be scored (``text="conversation"``: the training view of a draft trained without regeneration).
With ``engine="vllm"`` the states come from vLLM's own capture (the ``extract_hidden_states`` mode extract uses,
:meth:`eaglepipe.engines.vllm.VLLMEngine.capture`) of every boundary its capture loop reaches
(:func:`eaglepipe.contract.convention.capturable`): the draft is scored on what that engine serves it, in its
dtype and kernels (a quantized checkpoint's too); the target's top-1 stays transformers'.

Candidates: what the folder states (``eaglepipe.aux_boundaries``), what each engine feeds, each engine's default,
each of these shifted by ±1 and ±2, then a coordinate ascent from the best (each aux slot moved over every
boundary between its neighbours, until no move gains); on a target with at most :data:`EXHAUSTIVE` ascending sets,
every set. The best set is called the trained one when it stands
out: acceptance ≥ :data:`MIN_ACCEPTANCE` and ahead of the next-best set by ≥ :data:`Z` binomial standard errors
of its own acceptance; otherwise "cannot tell".
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eaglepipe.contract import convention as conv
from eaglepipe.contract import draft_config
from eaglepipe.contract.inspect import Report, inspect_draft
from eaglepipe.data.template import tokenize_conversation
from eaglepipe.engines.hf import boundary_hooks
from eaglepipe.errors import ConventionError
from eaglepipe.model.draft import KVCache, draft_step
from eaglepipe.model.draft_folder import load_draft_folder
from eaglepipe.serving.evaluate import eval_prompts, load_reference
from eaglepipe.serving.specdec import greedy_generate
from eaglepipe.target.config import read_target_config
from eaglepipe.target.hf_model import decoder

MIN_ACCEPTANCE = 0.05  # below it under every set, the draft does not fit this target at all
Z = 3.0  # standard errors the best set must lead the next by
SHIFTS = (-2, -1, 1, 2)
MAX_SWEEPS = 3
EXHAUSTIVE = 64  # score every ascending set when there are at most this many
HF, SERVED = "hf", "vllm"  # whose capture the draft reads (engine_table's names): transformers', or vLLM's as served
HF_STATES = "transformers float32"  # Diagnosis.states when the hf forward's hooks capture them


@dataclass
class Candidate:
    """One boundary set and its score."""

    boundaries: list[int]
    why: list[str]  # where it came from: "stated", "vllm 0.33.0 feeds", "sglang default -1", "search"
    accepted: int = 0
    positions: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.positions if self.positions else 0.0


@dataclass
class Diagnosis:
    """The result of :func:`diagnose`. ``trained_on`` None: no set stands out (``verdict`` says why)."""

    draft_dir: str
    draft_format: str
    n_layers: int
    prompts: int
    text: str  # "greedy": the target's greedy continuations; "conversation": the conversations' assistant turns
    candidates: list[Candidate]  # best first
    trained_on: list[int] | None
    margin: float  # best acceptance − next best
    threshold: float  # the margin needed (Z standard errors)
    verdict: str
    engines: dict[str, dict]  # engine → {"version", "feeds", "right", "field", "ids"} or {"version", "refused"}
    weights: list[str] = field(default_factory=list)  # inspect's problems with the folder's weights and config
    states: str = HF_STATES  # whose capture the draft read, e.g. "vllm 0.32.0 float32" (engine SERVED)

    @property
    def ok(self) -> bool:
        """A trained set was found and every engine that loads the folder feeds it."""
        return self.trained_on is not None and all(e.get("right", True) for e in self.engines.values())

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok,
                "candidates": [{**asdict(c), "acceptance": c.acceptance} for c in self.candidates]}


def greedy_sequences(model, eos_ids: set[int], prompts: list[list[int]], max_new_tokens: int) -> list[tuple]:
    """Each prompt + the target's greedy continuation (≤ ``max_new_tokens``), positions counted from the prompt's
    last token on → [(tokens, counted)] (``counted[t]``: the target's prediction at t is scored)."""
    out = []
    for prompt in prompts:
        cont, _ = greedy_generate(model, prompt, max_new_tokens, eos_ids)
        out.append((prompt + cont, [t >= len(prompt) - 1 for t in range(len(prompt) + len(cont))]))
    return out


def conversation_sequences(tok, records: list[dict], n: int, max_length: int = 2048) -> list[tuple]:
    """The first ``n`` conversations as rendered for training (:func:`eaglepipe.data.template.tokenize_conversation`),
    the positions of its loss mask counted (the target predicts an assistant token) → [(tokens, counted)]."""
    seqs = [tokenize_conversation(tok, r["messages"], max_length) for r in records[:n]]
    return [(t.input_ids.tolist(), t.loss_mask.tolist()) for t in seqs]


class Scorer:
    """Token sequences on the target: their boundaries h[0..N] and the target's top-1 captured once; any draft
    scored under any boundary set. ``served``: per sequence {k: (T, Ht)} from a serving engine's capture
    (:func:`served_states`) instead of transformers' h[0..N]; ``boundaries`` holds the k that can be scored."""

    def __init__(self, model, sequences: list[tuple[list[int], list[bool]]], served: list[dict] | None = None):
        layers = decoder(model).layers
        self.embed = decoder(model).embed_tokens.weight  # (V, H)
        self.seqs = []  # (tokens (T,) int64, target top-1 (T,), counted (T,) bool, {k: (T, Ht) float32})
        hooked = [] if served else list(range(len(layers) + 1))
        for j, (ids, counted) in enumerate(sequences):
            x = torch.tensor([ids], device=model.device)  # (1, T)
            with torch.inference_mode(), boundary_hooks(layers, hooked) as got:
                top = model(input_ids=x).logits[0].argmax(-1)  # (T,)
            states = ({k: v.to(x.device, torch.float32) for k, v in served[j].items()} if served
                      else {k: v[0] for k, v in got.items()})
            self.seqs.append((x[0], top, torch.tensor(counted, device=x.device), states))
        self.boundaries = set(self.seqs[0][3]) if self.seqs else set()

    @torch.inference_mode()
    def score(self, draft, boundaries: list[int]) -> tuple[int, int]:
        """(accepted, positions) of ``draft`` fed h[``boundaries``]: draft position t reads (g_t, x_{t+1}) and is
        accepted when its argmax is the target's top-1 at t+1, over the positions t+1 counted."""
        hits = count = 0
        for x, top, counted, states in self.seqs:
            T = x.shape[0]
            aux = torch.stack([states[k][: T - 1] for k in boundaries], dim=1)[None]  # (1, T-1, L, Ht)
            pos = torch.arange(T - 1, device=x.device)[None]  # (1, T-1)
            guess = draft_step(draft, self.embed, x[None, 1:], pos, KVCache(), aux=aux).logits[0].argmax(-1)
            mask = counted[1:]  # (T-1,)
            hits += int(((guess == top[1:]) & mask).sum())
            count += int(mask.sum())
        return hits, count


def served_states(target_dir: str | Path, family: str, n_layers: int, sequences: list[tuple], dtype: str,
                  ) -> tuple[list[dict[int, torch.Tensor]], str]:
    """Every boundary h[k] vLLM's capture loop reaches for ``family`` (``convention.capturable``), captured by vLLM
    serving the target at ``target_dir`` in ``dtype`` → (per sequence {k: (T, H) float32}, "vllm VERSION DTYPE").
    Raises ServingUnavailable / ConventionError as :class:`eaglepipe.engines.vllm.VLLMEngine` and the rules do."""
    from eaglepipe.engines import get_engine

    ks = list(conv.capturable(SERVED, family, n_layers))
    ids = conv.ids_reading_as(SERVED, family, ks, n_layers)  # the installed vLLM's meaning: it captures them
    engine = get_engine(SERVED, target_dir, dtype=dtype)
    try:
        caps = engine.capture([ids_ for ids_, _ in sequences], ids)  # per sequence (T, len(ids), H)
    finally:
        engine.close()
    return [{k: c[:, j] for j, k in enumerate(ks)} for c in caps], f"{engine.name} {engine.version} {dtype}"


def starting_sets(report: Report, n_aux: int) -> dict[tuple[int, ...], list[str]]:
    """The stated set, each engine's fed set and default, and their shifts (:data:`SHIFTS`) inside [0, N]."""
    base: dict[tuple[int, ...], list[str]] = {}
    if report.stated_boundaries:
        base.setdefault(tuple(report.stated_boundaries), []).append("stated (eaglepipe block)")
    for e, v in report.engines.items():
        if v.boundaries is not None:
            base.setdefault(tuple(v.boundaries), []).append(f"{e} {v.version} feeds")
        try:
            base.setdefault(tuple(conv.default_boundaries(e, report.family, report.n_layers, v.version)),
                            []).append(f"{e} default")
        except ConventionError:
            pass
    out = {b: why for b, why in base.items() if len(b) == n_aux}
    for b, why in list(out.items()):
        for s in SHIFTS:
            moved = tuple(k + s for k in b)
            if 0 <= moved[0] and moved[-1] <= report.n_layers:
                out.setdefault(moved, []).append(f"h{list(b)} {s:+d}")
    return out


def ascend(scored: dict, start: tuple[int, ...], n_layers: int, evaluate) -> None:
    """Coordinate ascent from ``start``: each slot over the boundaries strictly between its neighbours, until a sweep
    gains nothing (≤ :data:`MAX_SWEEPS`). ``evaluate(set, why)`` adds each new set to ``scored``."""
    best = start
    for _ in range(MAX_SWEEPS):
        before = best
        for i in range(len(best)):
            lo, hi = (best[i - 1] + 1 if i else 0), (best[i + 1] - 1 if i + 1 < len(best) else n_layers)
            for k in range(lo, hi + 1):
                b = best[:i] + (k,) + best[i + 1 :]
                if b not in scored:
                    evaluate(b, ["search"])
                if scored[b].accepted > scored[best].accepted:
                    best = b
        if best == before:
            return


def engine_needs(report: Report, trained: list[int]) -> dict[str, dict]:
    """Per engine: what it feeds now, whether that is ``trained``, and the ids (in its meaning and config field,
    :func:`eaglepipe.contract.convention.engine_ids`) that make it feed ``trained``."""
    out = {}
    for e, v in report.engines.items():
        if v.refused:
            out[e] = {"version": v.version, "refused": v.refused}
            continue
        row = {"version": v.version, "feeds": v.boundaries, "right": v.boundaries == trained,
               "field": draft_config.ID_FIELDS[e]}
        try:
            row["ids"] = conv.engine_ids(e, report.family, trained, report.n_layers, v.version)
        except ConventionError as err:
            row.update(ids=None, cannot=str(err))
        out[e] = row
    return out


def judge(ranked: list[Candidate]) -> tuple[list[int] | None, float, float, str]:
    """Scored sets, best first → (the trained set or None, margin over the next, the margin needed, verdict)."""
    best, nxt = ranked[0], (ranked[1] if len(ranked) > 1 else None)
    margin = best.acceptance - (nxt.acceptance if nxt else 0.0)
    threshold = Z * math.sqrt(best.acceptance * (1 - best.acceptance) / max(best.positions, 1))
    if best.acceptance < MIN_ACCEPTANCE:
        return None, margin, threshold, (
            f"cannot tell: the draft accepts {best.acceptance:.3f} at best, under every set tried: it does not fit "
            "this target (another target, or weights that do not load as written)")
    if nxt is None:
        return None, margin, threshold, f"cannot tell: only h{best.boundaries} was tried (search it)"
    if margin < threshold or margin <= 0:
        return None, margin, threshold, (
            f"cannot tell: h{best.boundaries} leads h{nxt.boundaries} by {margin:.3f}, under {Z:g} standard errors "
            f"({threshold:.3f}); give more prompts (--prompts-n) or longer continuations")
    verdict = f"trained on h{best.boundaries}: ahead of h{nxt.boundaries} by {margin:.3f}"
    return best.boundaries, margin, threshold, verdict


def score_sets(scorer: Scorer, draft, report: Report, search: bool) -> list[Candidate]:
    """The draft scored under :func:`starting_sets`, then every ascending set on a small target (≤
    :data:`EXHAUSTIVE`) or :func:`ascend` from the best → the candidates, best first."""
    n, a = report.n_layers, draft.cfg.n_aux
    scored: dict[tuple[int, ...], Candidate] = {}

    def evaluate(b: tuple[int, ...], why: list[str]) -> None:
        if set(b) <= scorer.boundaries:  # else the engine cannot feed that set: not a candidate
            scored[b] = Candidate(list(b), why, *scorer.score(draft, list(b)))

    for b, why in starting_sets(report, a).items():
        evaluate(b, why)
    if search and math.comb(n + 1, a) <= EXHAUSTIVE:
        for b in itertools.combinations(range(n + 1), a):
            if b not in scored:
                evaluate(b, ["search"])
    elif search:
        spread = tuple(round(n * (i + 1) / (a + 1)) for i in range(a))
        ascend(scored, max(scored, key=lambda b: scored[b].accepted) if scored else spread, n, evaluate)
    return sorted(scored.values(), key=lambda c: -c.accepted)


def diagnose(draft_dir: str | Path, target_dir: str | Path, records: list[dict], n_prompts: int = 8,
             max_new_tokens: int = 64, search: bool = True, versions: dict[str, str] | None = None,
             text: str = "greedy", engine: str = HF, engine_dtype: str = "float32") -> Diagnosis:
    """Score the draft at ``draft_dir`` on the target at ``target_dir`` (an HF folder) under candidate boundary sets
    (module docstring), on the first user turns of ``records`` (eaglepipe conversation records), ``n_prompts`` of
    them, ``max_new_tokens`` greedy tokens each; ``text`` "conversation": their own assistant turns as rendered for
    training, no generation. ``engine`` :data:`SERVED`: the states as vLLM captures them in ``engine_dtype``
    (:func:`served_states`). Raises EaglepipeError for what :func:`inspect_draft` and :func:`load_draft_folder`
    refuse, and what the engine refuses."""
    from transformers import AutoTokenizer

    report = inspect_draft(draft_dir, target_dir, versions)
    model, eos_ids = load_reference(Path(target_dir))
    draft = load_draft_folder(draft_dir, read_target_config(target_dir), model.device)
    tok = AutoTokenizer.from_pretrained(target_dir)
    if text == "greedy":
        prompts = [p["input_ids"] for p in eval_prompts(tok, records, n_prompts)]
        seqs = greedy_sequences(model, eos_ids, prompts, max_new_tokens)
    else:
        seqs = conversation_sequences(tok, records, n_prompts)
    served, states = (served_states(target_dir, report.family, report.n_layers, seqs, engine_dtype)
                      if engine != HF else (None, HF_STATES))
    scorer = Scorer(model, seqs, served)
    ranked = score_sets(scorer, draft, report, search)
    trained, margin, threshold, verdict = judge(ranked)
    return Diagnosis(str(draft_dir), report.draft_format, report.n_layers, len(scorer.seqs), text, ranked, trained,
                     margin, threshold, verdict, engine_needs(report, trained) if trained else {},
                     report.problems + [p for v in report.engines.values() for p in v.problems if v.loads], states)


def format_diagnosis(d: Diagnosis, top: int = 8) -> str:
    """The human-readable report: the best sets, the verdict, each engine's feed and the ids it needs."""
    pos = d.candidates[0].positions if d.candidates else 0
    lines = [(f"draft {d.draft_dir} ({d.draft_format}), target N = {d.n_layers}: {d.prompts} prompts, {pos} "
             f"positions, {len(d.candidates)} boundary sets tried, states captured by {d.states}"),
             "acceptance at draft position 1, teacher-forced on "
             + ("the target's greedy continuations:" if d.text == "greedy" else "the conversations' assistant turns:")]
    lines += [f"  h{c.boundaries}  {c.acceptance:.3f}  {'; '.join(c.why)}" for c in d.candidates[:top]]
    lines.append(d.verdict)
    for e, row in d.engines.items():
        if "refused" in row:
            lines.append(f"{e} {row['version']}: does not load this folder ({row['refused']})")
        elif row["ids"] is None:
            lines.append(f"{e} {row['version']}: feeds h{row['feeds']}; cannot feed h{d.trained_on}: {row['cannot']}")
        else:
            state = ("right" if row["right"] else f"WRONG, feeds h{row['feeds']}" if row["feeds"] is not None
                     else "WRONG, its ids cannot be fed (PROBLEM below)")
            lines.append(f"{e} {row['version']}: {state}; its config needs {row['field']} = {row['ids']}")
    lines += [f"PROBLEM {p}" for p in d.weights]
    return "\n".join(lines)
