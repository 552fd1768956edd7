"""The best evaluated epoch of a training run that is still going (or was killed), written as a draft.

    python3 lab/save_best_so_far.py data/drafter DEST     # prints: INTERIM {"epochs_ended": ..., ...}

For a device machine about to be taken back mid-training (``suite.sh ckpt-keep``): the newest checkpoint of
the newest run folder ``<scratch>/<run key>/`` under the train_drafter stage's scratch folder
(eaglepipe.stage.scratch_dir_of of its output, e.g. data/.scratch/drafter) is read (train_drafter writes each
file atomically and keeps the last complete save, so reading beside a running training is safe), and its best
epoch's weights are written to DEST as train_drafter writes a draft (config.json + model.safetensors,
eaglepipe.model.draft.save_draft), config.json holding ``interim``: the epochs ended, of how many, the optimizer
step, the best epoch and its τ_sim.

The checkpoint is read as data (safetensors + JSON, nothing unpickled) by
eaglepipe.train.checkpoint.read_checkpoint, FSDP2's per-rank shards joined: ``{"state": the loop's State (epoch,
step, best_epoch, best_tau, best_state), "draft": {"config": DraftConfig fields, "extra": config.json's other
entries, "epochs"}, ...}``. Run it in the checkout that trained (its eaglepipe reads the format it wrote).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CKPT = "ckpt-*.safetensors"  # eaglepipe.train.checkpoint.ckpt_file


def save_best_so_far(scratch_dir: str | Path, out_dir: str | Path) -> dict:
    """The best epoch so far of the run whose checkpoints are under ``scratch_dir``, written to ``out_dir``.

    Returns {"epochs_ended", "epochs", "step", "best_epoch", "best_tau_sim"} (also written as config.json's
    ``interim``). Raises EaglepipeError: no checkpoint under scratch_dir, or none with an evaluated epoch."""
    from eaglepipe.errors import EaglepipeError
    from eaglepipe.model.draft import DraftConfig, Eagle3Draft, save_draft
    from eaglepipe.train.checkpoint import read_checkpoint

    ckpts = sorted(Path(scratch_dir).glob(f"*/{CKPT}"), key=lambda f: f.stat().st_mtime)
    if not ckpts:
        raise EaglepipeError(f"no training checkpoint under {scratch_dir} (train_drafter writes <run key>/{CKPT})")
    run = ckpts[-1].parent
    ck = read_checkpoint(run)
    st, meta = ck["state"], ck.get("draft")
    if meta is None or st.best_state is None:
        raise EaglepipeError(f"{run}: no epoch has ended yet, so no evaluated weights to keep; wait for the "
                             "first epoch's eval line")
    draft = Eagle3Draft(DraftConfig(**meta["config"]))
    draft.load_state_dict(st.best_state)
    info = {"epochs_ended": st.epoch, "epochs": meta["epochs"], "step": st.step, "best_epoch": st.best_epoch,
            "best_tau_sim": st.best_tau}
    save_draft(draft, Path(out_dir), extra={**meta["extra"], "best_tau_sim": st.best_tau,
                                            "best_epoch": st.best_epoch, "interim": info})
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("draft_out", help="train_drafter's output folder (its checkpoints are in its scratch folder)")
    ap.add_argument("dest", help="where the best weights so far are written (config.json + model.safetensors)")
    a = ap.parse_args()
    from eaglepipe.errors import EaglepipeError
    from eaglepipe.stage import scratch_dir_of

    try:
        info = save_best_so_far(scratch_dir_of(a.draft_out), a.dest)
    except EaglepipeError as e:
        print(f"save_best_so_far: {e}", file=sys.stderr)
        return 1
    print("INTERIM", json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
