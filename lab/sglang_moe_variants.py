"""Issue 12 item 5 on the H200: which part of SGLang 0.5.17's DeepSeek-V3 path departs from transformers.

The third window's crosscheck found SGLang 0.5.17 (bf16) at cosine 0.59 / 0.22 / 0.23 / 0.14 against
transformers fp32 at h[2..5] of the seeds' tiny kimi_k2 target, vLLM 0.26 at >= 0.99992. Reading the 0.5.17
wheel points at its triton fused-MoE combine (``layers/moe/moe_runner/triton_utils/fused_moe.py``,
``_fused_moe_kernel_sequence``): with top-1 routing the down projection writes straight into the output
(``_use_intermediate`` is False), but a ``routed_scaling_factor`` other than 1 skips the "already written"
shortcut and sums the never-written ``intermediate_cache3`` instead; sglang PR #40187 ("Fix top-1 MoE routing
with non-unit scaling", in 0.5.23) fixes it. The seeds' target had top-1 routing and DeepseekV3Config's
default factor 2.5; real DeepSeek-V3 / Kimi-K2 checkpoints route top-8, so eaglepipe's tiny targets now route
top-2 (eaglepipe/target/tiny.py). These variants pin the cause in one device call:

    top1          the seeds' old routing (2 experts, top-1, factor 2.5): predicted to depart from h[2] on
    top1_rsf1     the same with routed_scaling_factor 1.0: predicted to match
    top1_patched  top1 with the one line of the installed SGLang changed to 0.5.23's form for its run: match
    default       today's tiny target (4 experts, top-2, 2 groups): predicted to match
    dense         no MoE layer (first_k_dense_replace 6): MLA and yarn alone: predicted to match

Runs THERE in SGLang's environment (``suite.sh sglang-moe``); each variant is hf fp32 against SGLang bf16 at
h[0..5] (ids in SGLang's meaning, eaglepipe.contract.convention) on the crosscheck's 4 conversations, one JSON a
variant as soon as it is done. ``--engine hf`` compares hf bf16 instead (a CPU check of this script).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]  # eaglepipe, h200_engines

TOP1 = {"n_routed_experts": 2, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}  # the seeds' old routing
# name -> config overrides of the tiny kimi_k2 (tiny_targets.build; transformers DeepseekV3Config keys)
VARIANTS: dict[str, dict] = {
    "top1": TOP1,
    "top1_rsf1": {**TOP1, "routed_scaling_factor": 1.0},
    "top1_patched": TOP1,
    "default": {},
    "dense": {"first_k_dense_replace": 6},
}
PATCHED = "top1_patched"
OLD = "_use_intermediate = not no_combine and (topk != 1 or hooks)"
NEW = "_use_intermediate = not no_combine and (topk != 1 or hooks or routed_scaling_factor not in (None, 1.0))"
BOUNDS = [0, 1, 2, 3, 4, 5]


def build_variant(name: str, work: Path) -> Path:
    """The tiny kimi_k2 with VARIANTS[name] over its config (seed 0), materialized as the target stage does."""
    from eaglepipe.target.info import materialize_target
    from eaglepipe.target.tiny import build

    dst = work / name / "target"
    if not (dst / "config.json").exists():
        materialize_target(str(build("kimi_k2", work / name / "src", **VARIANTS[name])), dst)
    return dst


def fused_moe_file() -> Path:
    import sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe as m

    return Path(m.__file__)


def run(a) -> None:
    from h200_engines import crosscheck_rows

    t0 = time.time()
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    opts = {"max_total_tokens": 2048} if a.engine == "sglang" else {}
    for name in a.variants:
        if time.time() - t0 > a.budget:
            print(f"SKIP {name}: budget {a.budget} s spent", flush=True)
            continue
        row: dict = {"variant": name, "overrides": VARIANTS[name]}
        patched = None
        try:
            tgt = build_variant(name, work)
            if name == PATCHED and a.engine == "sglang":  # the one line, for this variant's run only
                f = fused_moe_file()
                text = f.read_text()
                if OLD not in text:
                    raise RuntimeError(f"{f}: the 0.5.17 line is not there (already fixed?)")
                f.write_text(text.replace(OLD, NEW, 1))
                patched = (f, text)
            row.update(crosscheck_rows(a.engine, tgt, BOUNDS, **opts))
        except Exception as e:  # noqa: BLE001 — one variant's failure must not cost the others
            row["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
        finally:
            if patched is not None:
                patched[0].write_text(patched[1])
        row["elapsed_s"] = round(time.time() - t0, 1)
        (out / f"mla_{name}.json").write_text(json.dumps(row, indent=2) + "\n")
        print("RESULT", json.dumps(row)[:1200], flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--engine", default="sglang", help="sglang (THERE) | hf (hf bf16: a CPU check of the script)")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--budget", type=float, default=240, help="start no new variant after this many seconds")
    a = ap.parse_args()
    from h200_engines import gpu_env

    gpu_env()  # on the GPU: attention_backend triton, disable_cuda_graph, mem_fraction_static 0.35 (as crosscheck)
    run(a)
