"""Run dvc.yaml's stage commands in order without DVC (for machines that lack it, e.g. the GPU box).

Usage: python scripts/run_stages.py [STAGE ...]     (default: every stage, in dvc.yaml order)
The commands are read from dvc.yaml, so paths stay written in one place. No caching: every stage runs.
"""

import subprocess
import sys
import time
from pathlib import Path

import yaml


def main():
    from eaglepipe.sources import link_bundled

    link_bundled(Path.cwd())  # bundled/ links, as scripts/setup.sh makes them
    stages = yaml.safe_load(Path("dvc.yaml").read_text())["stages"]
    for name in sys.argv[1:] or list(stages):
        cmd = " ".join(stages[name]["cmd"].split())  # (no ${} in any cmd: deps only)
        print(f"=== {name}: {cmd}", flush=True)
        t0 = time.time()
        rc = subprocess.call(cmd, shell=True)
        print(f"=== {name}: exit {rc} in {time.time() - t0:.1f} s", flush=True)
        if rc:
            sys.exit(rc)


if __name__ == "__main__":
    main()
