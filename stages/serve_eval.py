"""Stage `serve_eval`: acceptance length τ of the exported draft, by the reference decoder and a real engine.

Usage: python stages/serve_eval.py TARGET_DIR DRAFTER_DIR EXPORT_DIR EVAL_JSONL METRICS_JSON REPORT_JSON ACC_CSV
Reads params `layers`, `framework`, `serve`, `extract.thinking` (other than "template": every prompt once with
thinking on and once off, a harmony target's with it on only; τ per mode by the reference decoder and the engine,
and the reference's inside the reasoning and the answer apart: an engine's counters cannot tell which tokens were
reasoning), `extract.reasoning_effort`.
Writes REPORT_JSON (per engine τ, acceptance per draft position, tokens/s with and without the draft, what
produced them) and METRICS_JSON (the few figures `dvc exp show` compares) and ACC_CSV (acceptance per draft
position and engine, a `dvc plots` bar chart). Exits 1, after writing both, when an engine's τ is below
`serve.min_tau` (nothing accepted).
The reference decoder runs the trained draft (DRAFTER_DIR) on the same prompts as the engine runs the export: when it
accepts and the engine does not, the message blames the export or the engine's reading of it, not the training.
"""

import json
import sys
from pathlib import Path

import pandas as pd
from transformers import AutoTokenizer

from eaglepipe.data.prompts import read_jsonl
from eaglepipe.engine_table import SERVING
from eaglepipe.engines import engine_version
from eaglepipe.engines.serve import serve_eagle3
from eaglepipe.errors import EaglepipeError, ServingUnavailable
from eaglepipe.serving.evaluate import (
    ZERO_ACCEPTANCE_CAUSES,
    acceptance_gate,
    compact_serve_metrics,
    eval_prompts,
    reference_eval,
)
from eaglepipe.stage import require_inputs, run, start, write_metrics
from eaglepipe.target.reasoning import has_off, template_text, thinking_switch


def serve_engine(framework: str, target_dir: Path, export_dir: Path, prompts: list[dict], s, tp: int = 1,
                 ep: bool = False) -> dict | None:
    """The real engine's served result (None for `hf`; a recorded skip where it cannot serve here, e.g. SGLang
    without CUDA: recorded, not faked); ``tp``, ``ep``: params tensor_parallel_size, expert_parallel. Prompts
    with a thinking mode are also served mode by mode: ``by_thinking`` {"on" / "off": τ, acceptance}."""
    if framework not in SERVING:
        return None
    modes = {}
    for i, q in enumerate(prompts):
        if q["thinking"] is not None:
            modes.setdefault("on" if q["thinking"] else "off", []).append(i)
    try:
        opts = {"quantization": s.quantization} if s.quantization else {}  # the target's; the draft stays as is
        res = serve_eagle3(framework, target_dir, export_dir / framework, [q["input_ids"] for q in prompts], s.k,
                           s.max_new_tokens, batch_sizes=tuple(s.batch_sizes), subsets=modes or None,
                           dtype=s.engine_dtype, tensor_parallel_size=tp, expert_parallel=ep, **opts)
    except ServingUnavailable as e:
        return {"skipped": str(e)}
    if "by_subset" in res:
        res["by_thinking"] = res.pop("by_subset")
    return res


def main():
    p = start("serve_eval")
    target_dir, drafter_dir, export_dir, eval_file, metrics, report_json, acc_csv = map(Path, sys.argv[1:8])
    require_inputs(target_dir, drafter_dir, eval_file, *([export_dir] if p.framework in SERVING else []))
    s = p.serve
    switch = thinking_switch(template_text(target_dir))
    # a draft for a reasoning target: both modes, where the template has an off (harmony has none)
    modes = (None,) if p.extract.thinking == "template" else (True, False) if has_off(switch) else (True,)
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = eval_prompts(tok, read_jsonl(eval_file), s.prompts, switch, modes, p.extract.reasoning_effort)
    out = {"k": s.k, "max_new_tokens": s.max_new_tokens, "prompts": [q["id"] for q in prompts],
           "params": {"layers": p.layers, "framework": p.framework, "serve": s.model_dump()}}
    out["reference"] = reference_eval(target_dir, drafter_dir, p.layers, prompts, s.k, s.max_new_tokens, tok=tok)
    res = serve_engine(p.framework, target_dir, export_dir, prompts, s, p.tensor_parallel_size, p.expert_parallel)
    if res is not None:
        res = {k: v for k, v in res.items() if not k.startswith("outputs_") or k == "outputs_equal"}
        out[p.framework] = {"engine": p.framework, "engine_version": engine_version(p.framework),
                            "quantization": s.quantization, "engine_dtype": s.engine_dtype, **res}
    tau_sim = json.loads((drafter_dir / "config.json").read_text()).get("best_tau_sim")
    engines = {name: out[name] for name in ("reference", p.framework) if name in out}
    failures, flags = acceptance_gate(engines, tau_sim, s.min_tau, s.max_sim_gap)
    out["gate"] = {"verdict": "fail" if failures else ("flagged" if flags else "ok"), "tau_sim": tau_sim,
                   "failures": failures, "flags": flags}
    write_metrics(report_json, out)
    write_metrics(metrics, compact_serve_metrics(out))
    rows = [{"position": f"{name} pos{i + 1}", "engine": name, "acceptance": round(a, 4)}
            for name, res in engines.items() if "acceptance_per_pos" in res
            for i, a in enumerate(res["acceptance_per_pos"])]
    pd.DataFrame(rows, columns=["position", "engine", "acceptance"]).to_csv(acc_csv, index=False)
    if failures:
        raise EaglepipeError("served acceptance is (near) zero:\n  " + "\n  ".join(failures)
                             + "\nlikely causes:\n  - " + "\n  - ".join(ZERO_ACCEPTANCE_CAUSES))


if __name__ == "__main__":
    run(main)
