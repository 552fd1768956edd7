"""Run dvc.yaml's stage commands in order without DVC (for machines that lack it, e.g. the GPU box).

Usage: python scripts/run_stages.py [--profile FILE ...] [--set SECTION.KEY=VALUE ...] [STAGE ...]
(default: every stage, in dvc.yaml order). The commands are read from dvc.yaml, so paths stay written in one
place. No caching: every stage runs. ``--profile`` merges params profiles (e.g. profiles/gpu.yaml, then
profiles/synthetic_topics.yaml) over params.yaml in order, section by section, and ``--set`` sets single params over that, as ``dvc exp run -S`` would; the
merged params.yaml is written in place (the stages read it).
"""

import argparse
import subprocess
import time
from pathlib import Path

import yaml


def apply_sets(params: dict, sets: list[str]) -> dict:
    """``params`` (params.yaml as a dict) with each ``SECTION.KEY=VALUE`` set (VALUE read as YAML), in place."""
    for kv in sets:
        key, value = kv.split("=", 1)
        section, name = key.split(".", 1)
        params[section][name] = yaml.safe_load(value)
    return params


def merge_profile(params: dict, profile: dict) -> dict:
    """``profile``'s sections over ``params``' (a section's keys merged, a top-level value replaced), in place."""
    for k, v in profile.items():
        params[k] = {**params[k], **v} if isinstance(v, dict) else v
    return params


def main():
    from eaglepipe.sources import link_bundled

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", nargs="+", default=[])
    ap.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("stages", nargs="*")
    a = ap.parse_args()
    if a.profile or a.set:
        params = yaml.safe_load(Path("params.yaml").read_text())
        for f in a.profile:
            merge_profile(params, yaml.safe_load(Path(f).read_text()))
        Path("params.yaml").write_text(yaml.safe_dump(apply_sets(params, a.set), sort_keys=False))
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
