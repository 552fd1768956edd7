"""Stage `prompts`: conversations → normalized, deduplicated, seeded train/eval split (+ MT-bench, HumanEval;
+ prompts.synthetic placeholder conversations the target writes at extract).

Usage: python stages/prompts.py OUT_DIR METRICS_JSON
Writes OUT_DIR/train.jsonl, OUT_DIR/eval.jsonl and METRICS_JSON (records read, kept, skipped by reason).
METRICS_JSON is written first, before the split: when too few conversations are usable the stage exits 2 with
the split that would fit, and the counts that explain it are on disk.
"""

import sys
from pathlib import Path

from eaglepipe.data.prompts import (
    SKIP_REASONS,
    humaneval_prompts,
    load_conversations,
    mtbench_first_turns,
    split,
    synthetic_records,
    write_jsonl,
)
from eaglepipe.stage import run, start, write_metrics


def main():
    p = start("prompts").prompts
    out_dir, metrics = Path(sys.argv[1]), sys.argv[2]
    ps = load_conversations(p.source, p.max_records, p.max_turns, p.max_chars, p.drop_leading_assistant)
    counts = {"source": p.source, "read": ps.read, "usable": len(ps.records), "bad_bytes": ps.bad_bytes,
              "skipped": {r: ps.skipped.get(r, 0) for r in SKIP_REASONS}}
    write_metrics(metrics, {**counts, "asked": {"train": p.train, "eval": p.eval}})  # kept if split refuses
    train, held_out = split(ps.records, p.train, p.eval, p.seed)
    mtbench = mtbench_first_turns() if p.mtbench else []
    humaneval = humaneval_prompts(p.humaneval)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "train.jsonl", train + synthetic_records(p.synthetic, p.synthetic_topics))
    write_jsonl(out_dir / "eval.jsonl", mtbench + humaneval + held_out)
    write_metrics(metrics, {
        **counts, "train": len(train), "synthetic": p.synthetic, "eval_conversations": len(held_out),
        "eval_mtbench": len(mtbench), "eval_humaneval": len(humaneval),
    })


if __name__ == "__main__":
    run(main)
