"""serve_eval's logic: acceptance length τ of the draft on held-out prompts, by the reference decoder and a
real engine, with tokens/s with and without the draft.

Prompts: the first ``n`` records of ``eval.jsonl`` (MT-bench first turns come first, then held-out
conversations), each rendered as its first user turn + the template's assistant header, for a reasoning target
once with thinking on and once off (its template's switch, :mod:`eaglepipe.target.reasoning`). Decoding is greedy.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from eaglepipe.data.template import generation_prompt, tokenize_generated
from eaglepipe.model.draft import load_draft
from eaglepipe.serving.specdec import (
    Eagle3Drafter,
    SpecStats,
    Target,
    greedy_generate,
    speculative_generate,
    split_rounds,
)
from eaglepipe.target.hf_model import decoder, load_model
from eaglepipe.target.reasoning import template_kwargs

log = logging.getLogger(__name__)


def eval_prompts(tok, records: list[dict], n: int, switch: str | None = None,
                 modes: tuple[bool | None, ...] = (None,), effort: str | None = None) -> list[dict]:
    """[{id, source, thinking, input_ids}] for the first ``n`` records (first user turn, system message kept), each
    rendered once per thinking mode in ``modes`` (True / False: the template's ``switch`` passed on / off; None:
    the template's default), mode by mode; ``effort``: a harmony template's reasoning_effort
    (:func:`eaglepipe.target.reasoning.template_kwargs`)."""
    out = []
    for on in modes:
        for r in records[:n]:
            msgs = r["messages"]
            upto = next(i for i, m in enumerate(msgs) if m["role"] == "user") + 1
            out.append({"id": r["id"], "source": r.get("source", ""), "thinking": on,
                        "input_ids": generation_prompt(tok, msgs[:upto], template_kwargs(switch, on, effort))})
    return out


def load_reference(target_dir: Path):
    """The reference decoder's target: the HF model (a causal LM or a multimodal wrapper:
    eaglepipe/target/hf_model.py) in float32, in eval mode, on CUDA when there is one (else
    the CPU), and its EOS token ids (generation_config's, one or a list) → ``(model, eos_ids)``."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(target_dir, torch.float32).to(dev).eval()
    eos = model.generation_config.eos_token_id
    return model, set(eos if isinstance(eos, list) else [eos])


@torch.inference_mode()
def decode_prompt(model, eos_ids: set[int], drafts: list, layers: list[int], prompt: list[int], k: int,
                  max_new_tokens: int, rounds: list[list] | None = None,
                  ) -> tuple[list[tuple[list[int], SpecStats]], list[int], float]:
    """One prompt through the reference decoder: speculative decoding with each of ``drafts`` (Eagle3Draft on the
    target's device, ``k`` tokens a round, aux states at ``layers``), then plain greedy decoding once (the
    baseline every draft's output must equal) → ([(tokens, SpecStats)] per draft, greedy tokens, greedy seconds).
    ``model``, ``eos_ids``: :func:`load_reference`'s; ``rounds``: one list a draft, given each round's
    (position, accepted) (:func:`eaglepipe.serving.specdec.speculative_generate`)."""
    embed = decoder(model).embed_tokens.weight
    rounds = rounds or [None] * len(drafts)
    runs = [speculative_generate(Target(model, layers), Eagle3Drafter(d, embed), prompt, k, max_new_tokens, eos_ids,
                                 log) for d, log in zip(drafts, rounds)]
    return (runs, *greedy_generate(model, prompt, max_new_tokens, eos_ids))


@torch.inference_mode()
def reference_eval(target_dir: Path, drafter_dir: Path, layers: list[int], prompts: list[dict], k: int,
                   max_new_tokens: int, keep_outputs: bool = False, tok=None) -> dict:
    """τ, acceptance per position and tokens/s of the plain-torch speculative decoder (HF target + draft)
    against plain greedy decoding of the same target, on the same prompts (fp32, CPU or CUDA).

    Returns a dict: tau, acceptance_per_pos, tau_by_source, tokens_per_s_draft / _plain, speedup,
    outputs_equal (speculative output == greedy output, token for token, for every prompt), and with
    ``keep_outputs`` the greedy outputs (token ids per prompt) as ``outputs_greedy``, to compare with an
    engine's plain outputs. Prompts with a ``thinking`` mode (:func:`eval_prompts`) add ``by_thinking``: {"on" /
    "off": {tau, acceptance_per_pos, rounds, new_tokens, "reasoning": {…}, "answer": {…}}}, the rounds split by
    whether their first drafted token is inside the target's reasoning (:func:`reasoning_inside`; ``tok``: the
    target's tokenizer, loaded from ``target_dir`` when not given).
    """
    model, eos_ids = load_reference(target_dir)
    dev = model.device.type
    draft = load_draft(drafter_dir, dev)
    if tok is None and any(q.get("thinking") is not None for q in prompts):
        tok = AutoTokenizer.from_pretrained(target_dir)
    total, by_source, by_mode, equal, plain_s, plain_tokens, greedy = SpecStats(k), {}, {}, 0, 0.0, 0, []
    for prompt in tqdm(prompts, desc="reference τ", unit="prompt"):
        rounds = []
        [(out, st)], ref, sec = decode_prompt(model, eos_ids, [draft], layers, prompt["input_ids"], k, max_new_tokens,
                                              [rounds])
        equal += out == ref
        greedy.append(ref)
        plain_s, plain_tokens = plain_s + sec, plain_tokens + len(ref)
        total += st
        by_source.setdefault(prompt["source"], SpecStats(k)).__iadd__(st)
        if prompt.get("thinking") is not None:
            mode = by_mode.setdefault("on" if prompt["thinking"] else "off", {"all": SpecStats(k)})
            mode["all"] += st
            for region, s in split_rounds(rounds, reasoning_inside(tok, prompt["input_ids"], out), k).items():
                mode.setdefault(region, SpecStats(k)).__iadd__(s)
    res = total.to_dict()
    res.pop("seconds")
    tps_draft, tps_plain = res.pop("tokens_per_s"), plain_tokens / plain_s
    return {
        "engine": "reference", "device": dev, **res,
        "tau_by_source": {s: v.tau for s, v in by_source.items()},
        "tokens_per_s_draft": tps_draft, "tokens_per_s_plain": tps_plain, "speedup": tps_draft / tps_plain,
        "outputs_equal": equal == len(prompts), "prompts_equal": equal,
        **({"outputs_greedy": greedy} if keep_outputs else {}),
        **({"by_thinking": {m: _mode_result(v) for m, v in by_mode.items()}} if by_mode else {}),
    }


def reasoning_inside(tok, prompt: list[int], out: list[int]) -> list[bool]:
    """Per token of ``out`` (the target's continuation of ``prompt``): inside its reasoning, from the open marker of
    the template's form (the prompt's own included: a template that opens ``<think>`` for the target) through its
    close marker (:func:`eaglepipe.data.template.tokenize_generated`). Raises CaptureMismatch when the tokenizer
    cannot encode either marker."""
    return tokenize_generated(tok, prompt, out, len(prompt) + len(out)).reasoning[len(prompt):].tolist()


def _mode_result(stats: dict[str, SpecStats]) -> dict:
    """One thinking mode's τ and acceptance: all its rounds, then its reasoning and answer rounds apart."""
    keep = ("tau", "acceptance_per_pos", "rounds", "new_tokens")
    res = {key: v for key, v in stats["all"].to_dict().items() if key in keep}
    for region in ("reasoning", "answer"):
        res[region] = {key: v for key, v in stats[region].to_dict().items() if key in keep[:3]}
    return res


ZERO_ACCEPTANCE_CAUSES = (
    "the aux layer ids the engine read (check metrics/offsets.json and `eaglepipe inspect` on the export)",
    "the draft-vocab mapping (d2t offsets / t2d mask inside the export's model.safetensors)",
    "the architecture string in the export's config.json (LlamaForCausalLMEagle3) or the engine's draft loader",
    "a RoPE or hidden-size mismatch between the draft and the target",
)


# τ by which the reference decoder (the trained draft, plain torch) must beat an engine serving the export on the
# same prompts before the export or the engine's reading of it is blamed: well above run-to-run noise (greedy
# decoding is deterministic; numerics move τ by ~0.01) and below the gap of a broken export (τ 1.30 vs 1.000).
REFERENCE_MARGIN = 0.1


def acceptance_gate(results: dict[str, dict], tau_sim: float | None, min_tau: float, max_sim_gap: float,
                    ) -> tuple[list[str], list[str]]:
    """Judge served acceptance: ``(failures, flags)``, each a list of human-readable lines.

    ``results``: engine name → its result dict with ``tau`` (mean acceptance length, 1.0 = nothing accepted);
    entries without ``tau`` (a skipped engine) are ignored; ``"reference"`` is the reference decoder running
    the trained draft on the same prompts. A τ below ``min_tau`` is a failure (the seeds' "25 % acceptance =
    nothing accepted" case); a τ more than ``max_sim_gap`` below the training-time τ_sim is a flag (EAGLE
    issue #264: train accuracy 0.9, served τ 1.2), as is an engine far from the reference. An engine below
    ``min_tau`` or near 1.0 while the reference reaches ``min_tau`` and beats it by :data:`REFERENCE_MARGIN`
    gets a line saying the training is not at fault, the export or that engine's reading of it is
    (:func:`export_at_fault`): a failure line beside its failure, else a flag.
    """
    failures, flags = [], []
    ref = results.get("reference", {}).get("tau")
    for name, res in results.items():
        tau = res.get("tau") if isinstance(res, dict) else None
        if tau is None:
            continue
        if tau < min_tau:
            failures.append(f"{name}: τ = {tau:.3f} < serve.min_tau = {min_tau} ({_accepted(res)})")
        if name != "reference" and export_at_fault(tau, ref, min_tau):
            (failures if tau < min_tau else flags).append(_export_blamed(name, tau, ref))
        if tau_sim is not None and tau < tau_sim - max_sim_gap:
            flags.append(f"{name}: served τ {tau:.3f} is {tau_sim - tau:.3f} below the trained draft's τ_sim "
                         f"{tau_sim:.3f} (serve.max_sim_gap = {max_sim_gap}): serving does not feed what training saw")
        if name != "reference" and ref is not None and abs(tau - ref) > max_sim_gap:
            flags.append(f"{name}: served τ {tau:.3f} vs reference decoder {ref:.3f} on the same prompts")
    if failures and tau_sim is not None and tau_sim < min_tau:
        failures.append(f"the draft itself accepts nothing on held-out features: its τ_sim is {tau_sim:.3f} — "
                        "it is undertrained (more data or epochs), not miswired; for a smoke run lower serve.min_tau")
    return failures, flags


def export_at_fault(tau: float, ref: float | None, min_tau: float) -> bool:
    """Whether an engine's τ, against the reference decoder's ``ref`` on the same prompts, blames the export or
    the engine's reading of it rather than the training: the engine accepts (almost) nothing (below
    ``min_tau`` or within :data:`REFERENCE_MARGIN` of 1.0) while the trained draft, run by the reference
    decoder, reaches ``min_tau`` and beats the engine by at least :data:`REFERENCE_MARGIN`."""
    if ref is None:
        return False
    engine_low = tau < min_tau or tau < 1.0 + REFERENCE_MARGIN
    return engine_low and ref >= min_tau and ref >= tau + REFERENCE_MARGIN


def _export_blamed(name: str, tau: float, ref: float) -> str:
    """The line that names the export (or ``name``'s reading of it), not the training, as the fault."""
    return (f"{name}: the reference decoder reaches τ {ref:.3f} with the trained draft on the same prompts, {name} "
            f"{tau:.3f} with its export: the training is not at fault; the export or {name}'s reading of it is — "
            "the aux layer ids in the exported config.json, d2t / t2d in its model.safetensors, its RoPE and "
            f"architectures fields (`eaglepipe inspect` on the {name} export folder names each)")


def _accepted(res: dict) -> str:
    """'A of D drafted tokens accepted' from an engine's counters, or from the reference decoder's rounds."""
    if "accepted_tokens" in res and "draft_tokens" in res:
        return f"{res['accepted_tokens']} of {res['draft_tokens']} drafted tokens accepted"
    if "rounds" in res and "acceptance_per_pos" in res:
        k = len(res["acceptance_per_pos"])
        accepted = round(sum(res["acceptance_per_pos"]) * res["rounds"])
        return f"{accepted} of {res['rounds'] * k} drafted tokens accepted over {res['rounds']} verify steps"
    return "acceptance counts not reported"


def compact_serve_metrics(report: dict) -> dict:
    """The few served figures ``dvc exp show`` compares: per engine τ, acceptance per position, tokens/s,
    speed-up and greedy equality (and τ per thinking mode: all, reasoning, answer), plus the gate's verdict. The
    full report goes to reports/serve_eval.json."""
    out = {"k": report["k"], "gate": report["gate"]["verdict"]}
    for name, res in report.items():  # the reference decoder and each engine that served (skips have no τ)
        if not isinstance(res, dict) or "tau" not in res:
            continue
        out[name] = {
            "tau": round(res["tau"], 4),
            "acc": {f"pos{i + 1}": round(a, 4) for i, a in enumerate(res["acceptance_per_pos"])},
            "tokens_per_s": round(res["tokens_per_s_draft"], 2), "speedup": round(res["speedup"], 3),
            "outputs_equal": res["outputs_equal"],
            **{f"speedup_bs{b}": round(r["speedup"], 3) for b, r in res.get("by_batch_size", {}).items()},
            **({"thinking": _thinking_taus(res["by_thinking"])} if "by_thinking" in res else {}),
        }
    return out


def _thinking_taus(by_thinking: dict) -> dict:
    """{mode: {"tau", "reasoning", "answer"}}: the τ of a ``by_thinking`` result (:func:`reference_eval`; an
    engine's has no "reasoning" / "answer": its counters are per run, not per token)."""
    return {m: {"tau": round(v["tau"], 4), **{r: round(v[r]["tau"], 4) for r in ("reasoning", "answer") if r in v}}
            for m, v in by_thinking.items()}
