"""Stage `check_params`: validate all of params.yaml whenever it changes (~1 s).

Usage: python stages/check_params.py OK_JSON
Every other stage reads only its own sections, so DVC would never rerun anything for a key no stage lists
(a misspelt top-level `framwork: sglang`): this stage depends on the whole file, so `dvc repro` (of any
stage: target and prompts depend on OK_JSON) fails here, exit 2, with the key named. OK_JSON's content is
constant, so a valid change of params reruns only the stages that read the changed keys. It also checks this
host's GPUs (or cores) against the parallel layout (eaglepipe/host.py), exit 2 naming a layout that fits, and
train.draft_norms against what the serving engine reads (eaglepipe/contract/variants.py).
"""

import sys
from pathlib import Path

from eaglepipe.atomic import atomic_write_json
from eaglepipe.contract.variants import require_served
from eaglepipe.host import check_host
from eaglepipe.stage import run, start


def main():
    p = start("check_params")
    check_host(p)  # GPUs / cores against the parallel layout: this is the host's first stage
    require_served(p.framework, p.train.draft_norms)  # an EAGLE-3.1 norm the serving engine does not read
    ok = Path(sys.argv[1])
    ok.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(ok, {"params.yaml": "valid"})


if __name__ == "__main__":
    run(main)
