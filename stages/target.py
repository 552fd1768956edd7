"""Stage `target`: make the target an HF folder.

Usage: python stages/target.py OUT_DIR METRICS_JSON
Reads params `target`; writes OUT_DIR (safetensors, config, tokenizer + chat template) and METRICS_JSON
(N, hidden size, vocab, dtype, content hash).
"""

import sys
from dataclasses import asdict

from eaglepipe.stage import run, start, write_metrics
from eaglepipe.target.info import materialize_target


def main():
    p = start("target")
    out_dir, metrics = sys.argv[1:3]
    info = materialize_target(p.target.source, out_dir, p.target.dtype)
    write_metrics(metrics, asdict(info))


if __name__ == "__main__":
    run(main)
