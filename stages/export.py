"""Stage `export`: one folder per engine, loadable by that engine as is.

Usage: python stages/export.py TARGET_DIR DRAFTER_DIR OUT_DIR
Reads params `layers`, `framework`; writes OUT_DIR/vllm and OUT_DIR/sglang (config.json with the aux ids in
that engine's meaning and place, model.safetensors) for each engine whose id rule can express `layers`, and
OUT_DIR/engines.json saying which folders exist and why one is absent (with the nearest layer lists that
work). Refuses (exit 2) layers the `framework` engine cannot express; (exit 1) a draft with
missing/unexpected/misshapen tensors or ids that do not translate back to `layers`.
"""

import sys
from pathlib import Path

from eaglepipe.serving.export import export_all
from eaglepipe.stage import require_inputs, run, start


def main():
    p = start("export")
    target_dir, drafter_dir, out_dir = map(Path, sys.argv[1:4])
    require_inputs(target_dir, drafter_dir)
    export_all(drafter_dir, target_dir, out_dir, p.layers, p.framework)


if __name__ == "__main__":
    run(main)
