"""Stage `export`: one folder per engine, loadable by that engine as is.

Usage: python stages/export.py TARGET_DIR DRAFTER_DIR OUT_DIR
Reads params `layers`; writes OUT_DIR/vllm and OUT_DIR/sglang (config.json with the aux ids in that engine's
meaning and place, model.safetensors). Refuses (exit 1) a draft with missing/unexpected/misshapen tensors or
ids that do not translate back to `layers`.
"""

import sys
from pathlib import Path

from eaglepipe.export import export_draft
from eaglepipe.stage import run, start

ENGINES = ("vllm", "sglang")


def main():
    p = start("export")
    target_dir, drafter_dir, out_dir = map(Path, sys.argv[1:4])
    for engine in ENGINES:
        export_draft(drafter_dir, target_dir, engine, out_dir / engine, p.layers)


if __name__ == "__main__":
    run(main)
