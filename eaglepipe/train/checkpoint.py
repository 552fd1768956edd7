"""Resuming a killed run: the :class:`State` of the loop and the checkpoint file that carries it.

Scratch contract: ``<scratch_dir>/<run key>/last.pt``, outside DVC's outs (``dvc repro`` empties those before a
stage runs). The run key (:func:`checkpoint_key`) hashes everything that changes the result (train params, the
features' own run key and sample count, the target's config, the world size), so a checkpoint of other
params or data is never resumed. Rank 0 writes it atomically (:func:`eaglepipe.atomic.atomic_path`) every
``train.checkpoint_every`` optimizer steps and at each epoch's end; every rank resumes from it (nothing random is
drawn during training, so rank 0's RNG state suffices); train_drafter removes the folder once the draft is
written. A checkpoint holds ``{"model", "optimizer", "scheduler", "rng", "state", "draft"}``: the draft's,
AdamW's and the schedule's ``state_dict()``, :func:`eaglepipe.train.distributed.rng_state`, the :class:`State`,
and ``{"config": DraftConfig.to_dict(), "extra": config.json's other entries, "epochs": train.epochs}``.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eaglepipe.atomic import atomic_path
from eaglepipe.data.features import run_key
from eaglepipe.params import TrainParams
from eaglepipe.train.distributed import Dist, barrier, rng_state, set_rng_state

log = logging.getLogger(__name__)

CKPT = "last.pt"


@dataclass
class State:
    """Everything a resumed run needs besides model / optimizer / scheduler: the loop's counters and history."""

    epoch: int = 0  # current epoch
    micro: int = 0  # next micro-batch (this rank's list) within the epoch
    step: int = 0  # optimizer steps done
    tokens: int = 0  # token positions processed, all ranks
    seconds: float = 0.0  # training wall time so far
    best_tau: float = -1.0  # τ_sim of the best evaluated epoch
    best_epoch: int = -1
    best_acc: list = field(default_factory=list)  # per-TTT-step accuracy of the best epoch
    best_state: dict | None = None  # draft weights (cpu) of the best epoch
    evals: list = field(default_factory=list)  # one dict per epoch (evaluation.eval_summary + epoch, step)
    losses: list = field(default_factory=list)  # train loss per optimizer step (for tests and the json)
    padding: list = field(default_factory=list)  # padding fraction of each epoch's rows
    curves: list = field(default_factory=list)  # (step, {name: value}) every dvclive row so far, replayed on resume


def checkpoint_key(p: TrainParams, manifest: dict, n_samples: int, target_config: dict, world: int) -> str:
    """The run key: 16 hex digits of what makes the result (``capture_stream`` and ``compile_capture`` change
    only speed, so a run resumes across them)."""
    return run_key({"train": p.model_dump(exclude={"capture_stream", "compile_capture"}),
                    "features": manifest.get("run_key"), "n": n_samples, "target": target_config, "world": world})


class Checkpoint:
    """``<scratch_dir>/<key>/last.pt`` of this run (module docstring); ``d``: who writes (rank 0) and waits;
    ``meta``: the checkpoint's ``"draft"`` entry."""

    def __init__(self, scratch_dir: str | Path, key: str, d: Dist, meta: dict):
        self.path = Path(scratch_dir) / key / CKPT
        self.d, self.meta = d, meta

    def load(self, draft: torch.nn.Module, opt: torch.optim.Optimizer, sched) -> State:
        """Load the checkpoint into ``draft``, ``opt``, ``sched`` and the global RNGs when a killed run left one,
        returning its State (fields added since it was written take their defaults); else a fresh State. Rank 0
        creates the checkpoint folder."""
        st = State()
        if self.path.exists():
            ck = torch.load(self.path, map_location="cpu", weights_only=False)
            draft.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            sched.load_state_dict(ck["scheduler"])
            set_rng_state(ck["rng"])
            st = State(**{**vars(State()), **vars(ck["state"])})
            log.info("resumed %s at epoch %d, micro-batch %d, step %d", self.path, st.epoch, st.micro, st.step)
        if self.d.main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        return st

    def save(self, draft: torch.nn.Module, opt: torch.optim.Optimizer, sched, st: State) -> None:
        """Write the checkpoint atomically (rank 0); every rank waits for it."""
        if self.d.main:
            with atomic_path(self.path) as tmp:
                torch.save({"model": draft.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "rng": rng_state(), "state": st, "draft": self.meta},
                           tmp)
        barrier(self.d)

    def remove(self) -> None:
        """Delete the run's scratch folder (the draft is written; nothing is left to resume)."""
        shutil.rmtree(self.path.parent, ignore_errors=True)
