"""Run dvc.yaml's stage commands in order without DVC, for a device machine that has no DVC.

Usage: python lab/run_stages.py [--profile FILE ...] [--set KEY.PATH=VALUE ...] [STAGE ...]
(default: every stage, in dvc.yaml order). The commands are read from dvc.yaml, so paths stay written in one
place. No caching: every stage runs. ``--profile`` applies params profiles (e.g. profiles/gpu.yaml, then
profiles/synthetic_topics.yaml) over params.yaml in order and ``--set`` single params over those, as
``dvc exp run $(eaglepipe profile ...) -S ...`` would (eaglepipe.profiles: the same merge, validated); the
merged params.yaml is written in place (the stages read it).
"""

import argparse
import subprocess
import time
from pathlib import Path

import yaml


def main():
    from eaglepipe.params import parse_params
    from eaglepipe.profiles import apply_sets, merged_params
    from eaglepipe.sources import link_bundled

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", nargs="+", default=[])
    ap.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("stages", nargs="*")
    a = ap.parse_args()
    if a.profile or a.set:
        params = merged_params(*a.profile) if a.profile else yaml.safe_load(Path("params.yaml").read_text())
        parse_params(apply_sets(params, a.set))  # a bad --set fails before any stage
        Path("params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    link_bundled(Path.cwd())  # bundled/ links, as scripts/setup.sh makes them
    stages = yaml.safe_load(Path("dvc.yaml").read_text())["stages"]
    for name in a.stages or list(stages):
        cmd = " ".join(stages[name]["cmd"].split())  # (no ${} in any cmd: deps only)
        print(f"=== {name}: {cmd}", flush=True)
        t0 = time.time()
        rc = subprocess.call(cmd, shell=True)
        print(f"=== {name}: exit {rc} in {time.time() - t0:.1f} s", flush=True)
        if rc:
            raise SystemExit(rc)


if __name__ == "__main__":
    main()
