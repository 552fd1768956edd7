"""Stage `serve_eval`: acceptance length τ of the exported draft, by the reference decoder and a real engine.

Usage: python stages/serve_eval.py TARGET_DIR DRAFTER_DIR EXPORT_DIR PROMPTS_DIR METRICS_JSON
Reads params `layers`, `framework`, `serve`. Writes METRICS_JSON: per engine τ, acceptance per draft position,
tokens/s with and without the draft, and what produced them (engine, version, k, prompts, params).
"""

import sys
from pathlib import Path

from transformers import AutoTokenizer

from eaglepipe.engines import engine_version
from eaglepipe.evaluate import eval_prompts, reference_eval
from eaglepipe.prompts import read_jsonl
from eaglepipe.stage import run, start, write_metrics


def main():
    p = start("serve_eval")
    target_dir, drafter_dir, export_dir, prompts_dir, metrics = map(Path, sys.argv[1:6])
    s = p.serve
    prompts = eval_prompts(AutoTokenizer.from_pretrained(target_dir), read_jsonl(prompts_dir / "eval.jsonl"), s.prompts)
    out = {"k": s.k, "max_new_tokens": s.max_new_tokens, "prompts": [q["id"] for q in prompts],
           "params": {"layers": p.layers, "framework": p.framework, "serve": s.model_dump()}}
    out["reference"] = reference_eval(target_dir, drafter_dir, p.layers, prompts, s.k, s.max_new_tokens)
    ids = [q["input_ids"] for q in prompts]
    if p.framework == "vllm":
        from eaglepipe.engines.vllm import serve_eagle3
        res = serve_eagle3(target_dir, export_dir / "vllm", ids, s.k, s.max_new_tokens)
    elif p.framework == "sglang":
        from eaglepipe.engines.sglang import SGLangError, serve_eagle3
        try:
            res = serve_eagle3(target_dir, export_dir / "sglang", ids, s.k, s.max_new_tokens)
        except SGLangError as e:  # EAGLE-3 serving needs SGLang's CUDA kernels: recorded, not faked
            res = {"skipped": str(e)}
    else:
        res = None
    if res is not None:
        res = {k: v for k, v in res.items() if not k.startswith("outputs_") or k == "outputs_equal"}
        out[p.framework] = {"engine": p.framework, "engine_version": engine_version(p.framework), **res}
    write_metrics(metrics, out)


if __name__ == "__main__":
    run(main)
