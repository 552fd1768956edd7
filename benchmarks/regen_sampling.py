"""What vLLM's per-request seeds cost when the target writes user turns (issue 13, regeneration speed).

extract writes a synthetic record's user turn with one ``SamplingParams(seed=seed + i)`` per prompt
(:meth:`eaglepipe.engines.vllm.VLLMEngine._params`), so that a record's text does not depend on the shard it
falls in. vLLM's V1 sampler draws a seeded request's noise on its own (``random_sample`` in
``vllm/v1/sample/ops/topk_topp_sampler.py`` loops ``exponential_(generator=...)`` over the seeded requests),
which at ``max_num_seqs`` ~1,000 could be ~1,000 small kernels per decode step. This times one vLLM instance
(started as extract starts it: :func:`eaglepipe.engines.get_engine`, ``EAGLEPIPE_VLLM_ARGS`` included) on the
same Magpie prompts (:func:`eaglepipe.data.template.user_prompt`, no messages) sampled three ways, alternating,
after a warm-up: seeded per prompt (as extract does), one unseeded ``SamplingParams`` for all (vLLM's global
generator), and greedy (no sampling noise at all, the floor).

    python benchmarks/regen_sampling.py --target data/target --n 8192 --out regen_sampling.json

Prints one ``RESULT {json}`` line: per mode the seconds, generated tokens and generated tokens/s of each
repeat, and the instance's start-up seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from transformers import AutoTokenizer

from eaglepipe.data.template import user_prompt
from eaglepipe.engines import get_engine


def _modes(n: int, max_new: int, temperature: float, seed: int) -> dict:
    from vllm import SamplingParams

    from eaglepipe.engines.vllm import VLLMEngine

    return {
        "seeded_per_prompt": VLLMEngine._params(n, max_new, temperature, seed),
        "unseeded": SamplingParams(max_tokens=max_new, temperature=temperature, top_p=1.0, detokenize=False),
        "greedy": SamplingParams(max_tokens=max_new, temperature=0.0, detokenize=False),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="data/target")
    ap.add_argument("--n", type=int, default=8192, help="prompts per generate call")
    ap.add_argument("--max-new", type=int, default=192, help="extract.max_new_tokens of profiles/gpu.yaml")
    ap.add_argument("--temperature", type=float, default=1.0, help="extract.synthetic_temperature's default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(a.target)
    prompt = user_prompt(tok, [])
    prompts = [prompt] * a.n
    with get_engine("vllm", a.target, dtype=a.dtype) as eng:
        llm = eng._start(("generate",))
        w = min(256, a.n)
        eng._run(llm, prompts[:w], _modes(w, a.max_new, a.temperature, 0)["seeded_per_prompt"])  # warm-up
        rows = []
        for r in range(a.repeats):
            for mode, params in _modes(a.n, a.max_new, a.temperature, 1000 * (r + 1)).items():
                outs, s = eng._run(llm, prompts, params)
                toks = sum(len(o) for o in outs)
                rows.append({"mode": mode, "repeat": r, "seconds": round(s, 2), "generated_tokens": toks,
                             "tokens_per_s": round(toks / s, 1)})
                print(json.dumps(rows[-1]), flush=True)
        res = {"n": a.n, "max_new_tokens": a.max_new, "temperature": a.temperature, "dtype": a.dtype,
               "startup_s": round(eng.startup_s.get("generate", float("nan")), 1),
               "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER"),
               "llm_args": os.environ.get("EAGLEPIPE_VLLM_ARGS"), "rows": rows,
               "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print("RESULT " + json.dumps(res), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
