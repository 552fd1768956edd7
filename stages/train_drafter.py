"""Stage `train_drafter`: train the EAGLE-3 draft on the stored features, keep the epoch with the best τ_sim.

Usage: python stages/train_drafter.py FEATURES_DIR TARGET_DIR OUT_DIR METRICS_JSON REPORT_JSON LIVE_DIR
Reads params `layers`, `train`; writes OUT_DIR (config.json + model.safetensors with fc / midlayer / norm /
lm_head / d2t / t2d, see eaglepipe/model/draft.py), REPORT_JSON (the whole summary), METRICS_JSON (best τ_sim,
its epoch and acceptance per TTT step, tokens/s) and the dvclive curves in LIVE_DIR. With train.nproc_per_node
N > 1 it runs itself again as N torchrun ranks (`torchrun --standalone --nproc_per_node N` with the same
arguments; DDP or FSDP2 by train.parallel) and exits with their code; rank 0 writes the outputs. Killed and
restarted with the same params and features, it resumes from its last checkpoint (scratch under data/.scratch/).
"""

import os
import sys
from pathlib import Path

from eaglepipe.data.features import FeatureSet
from eaglepipe.stage import require_inputs, run, scratch_dir_of, start, write_metrics
from eaglepipe.train.distributed import launch_ranks
from eaglepipe.train.loop import train_drafter


def main():
    p = start("train_drafter")
    code = launch_ranks(p.train.nproc_per_node)
    if code is not None:
        raise SystemExit(code)
    features, target_dir, out_dir, metrics, report, live_dir = map(Path, sys.argv[1:7])
    require_inputs(features, target_dir)
    FeatureSet(features).require_layers(p.layers)
    summary = train_drafter(features, target_dir, out_dir, p.train, scratch_dir=scratch_dir_of(out_dir),
                            live_dir=live_dir)
    summary.pop("losses")
    if int(os.environ.get("RANK", "0")) == 0:
        write_metrics(report, {**summary, "params": {"layers": p.layers, "train": p.train.model_dump()}})
        best = summary["best"]
        write_metrics(metrics, {"tau_sim": best["tau_sim"], "epoch": best["epoch"], "acc": best["acc"],
                                "tokens_per_s": summary["tokens_per_s"]})


if __name__ == "__main__":
    run(main)
