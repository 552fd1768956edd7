"""serve_eval's logic: acceptance length τ of the draft on held-out prompts, by the reference decoder and a
real engine, with tokens/s with and without the draft.

Prompts: the first ``n`` records of ``eval.jsonl`` (MT-bench first turns come first, then held-out
conversations), each rendered as its first user turn + the template's assistant header. Decoding is greedy.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from .draft import load_draft
from .specdec import Eagle3Drafter, SpecStats, Target, greedy_generate, speculative_generate
from .template import generation_prompt

log = logging.getLogger(__name__)


def eval_prompts(tok, records: list[dict], n: int) -> list[dict]:
    """[{id, source, input_ids}] for the first ``n`` records (first user turn, system message kept)."""
    out = []
    for r in records[:n]:
        msgs = r["messages"]
        upto = next(i for i, m in enumerate(msgs) if m["role"] == "user") + 1
        out.append({"id": r["id"], "source": r.get("source", ""), "input_ids": generation_prompt(tok, msgs[:upto])})
    return out


@torch.inference_mode()
def reference_eval(target_dir: Path, drafter_dir: Path, layers: list[int], prompts: list[dict], k: int,
                   max_new_tokens: int) -> dict:
    """τ, acceptance per position and tokens/s of the plain-torch speculative decoder (HF target + draft)
    against plain greedy decoding of the same target, on the same prompts (fp32, CPU or CUDA).

    Returns a dict: tau, acceptance_per_pos, tau_by_source, tokens_per_s_draft / _plain, speedup,
    outputs_equal (speculative output == greedy output, token for token, for every prompt).
    """
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(dev).eval()
    draft = load_draft(drafter_dir, dev)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    embed = model.model.embed_tokens.weight
    total, by_source, equal, plain_s, plain_tokens = SpecStats(k), {}, 0, 0.0, 0
    for p in tqdm(prompts, desc="reference τ", unit="prompt"):
        out, st = speculative_generate(Target(model, layers), Eagle3Drafter(draft, embed), p["input_ids"], k,
                                       max_new_tokens, eos_ids)
        ref, sec = greedy_generate(model, p["input_ids"], max_new_tokens, eos_ids)
        equal += out == ref
        plain_s, plain_tokens = plain_s + sec, plain_tokens + len(ref)
        total += st
        by_source.setdefault(p["source"], SpecStats(k)).__iadd__(st)
    res = total.to_dict()
    res.pop("seconds")
    tps_draft, tps_plain = res.pop("tokens_per_s"), plain_tokens / plain_s
    return {
        "engine": "reference", "device": dev, **res,
        "tau_by_source": {s: v.tau for s, v in by_source.items()},
        "tokens_per_s_draft": tps_draft, "tokens_per_s_plain": tps_plain, "speedup": tps_draft / tps_plain,
        "outputs_equal": equal == len(prompts), "prompts_equal": equal,
    }
