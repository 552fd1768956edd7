"""Resuming a killed run: the :class:`State` of the loop and the checkpoint files that carry it.

Scratch contract: ``<scratch_dir>/<run key>/``, outside DVC's outs (``dvc repro`` empties those before a stage
runs). The run key (:func:`checkpoint_key`) hashes everything that changes the result (train params, the
features' own run key and sample count, the target's config, the world size), so a checkpoint of other params
or data is never resumed. Every ``train.checkpoint_every`` optimizer steps and at each epoch's end the run
saves ``ckpt-<save:06d>.rank<r>.safetensors`` (:func:`ckpt_file`), each file written atomically in the format
of eaglepipe/train/safe_tree.py (safetensors + JSON: reading one runs no code; anything else is refused):

- one process or DDP: one file a save, rank 0's (the ranks' weights are equal; nothing random is drawn during
  training, so rank 0's RNG state suffices);
- FSDP2 (``train.parallel: fsdp``): one file a rank, each with that rank's shards of the weights, of the best
  epoch's weights and of the AdamW state (all listed in its metadata's ``sharded``) and the whole State.

Once every rank has written save n, each removes its own older files, so the newest *complete* save (all its
files present) is always on disk, also when a kill lands between two ranks' writes. A file's tree is
``{"model", "optimizer", "scheduler", "rng", "state", "draft"}``: the draft's, AdamW's and the schedule's
``state_dict()``, :func:`eaglepipe.train.distributed.rng_state`, ``vars(State)``, and ``{"config":
DraftConfig.to_dict(), "extra": config.json's other entries, "epochs": train.epochs}``; its metadata has
``rank`` and ``files`` (how many files the save has). train_drafter removes the folder once the draft is written.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from eaglepipe.data.features import run_key
from eaglepipe.errors import TrainingError
from eaglepipe.params import TrainParams
from eaglepipe.train.distributed import Dist, barrier, like, rng_state, set_rng_state
from eaglepipe.train.safe_tree import decode_tree, read_meta, read_raw, read_tree, write_tree

log = logging.getLogger(__name__)

NAME = re.compile(r"ckpt-(\d{6})\.rank(\d+)\.safetensors")


def ckpt_file(folder: Path, save: int, rank: int) -> Path:
    """Rank ``rank``'s file of save number ``save`` (1, 2, ... in the run's order) in the run's folder."""
    return Path(folder) / f"ckpt-{save:06d}.rank{rank}.safetensors"


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
    best_state: dict | None = None  # draft weights (cpu; FSDP2: this rank's shards) of the best epoch
    evals: list = field(default_factory=list)  # one dict per epoch (evaluation.eval_summary + epoch, step)
    losses: list = field(default_factory=list)  # train loss per optimizer step (for tests and the json)
    padding: list = field(default_factory=list)  # padding fraction of each epoch's rows
    curves: list = field(default_factory=list)  # (step, {name: value}) every dvclive row so far, replayed on resume

    @classmethod
    def from_dict(cls, d: dict) -> "State":
        """A State from ``vars()`` of one (fields added since it was written take their defaults)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def checkpoint_key(p: TrainParams, manifest: dict, n_samples: int, target_config: dict, world: int) -> str:
    """The run key: 16 hex digits of what makes the result (``capture_stream`` and ``compile_capture`` change
    only speed, so a run resumes across them; ``nproc_per_node`` only launches the ``world`` ranks)."""
    return run_key({"train": p.model_dump(exclude={"capture_stream", "compile_capture", "nproc_per_node"}),
                    "features": manifest.get("run_key"), "n": n_samples, "target": target_config, "world": world})


def complete_saves(folder: Path) -> dict[int, list[Path]]:
    """save number → its files in rank order, for every save whose files are all present (rank 0's metadata
    says how many it has). Raises TrainingError naming a rank-0 file that is not a checkpoint."""
    found: dict[int, dict[int, Path]] = {}
    for f in Path(folder).glob("ckpt-*.safetensors"):
        m = NAME.fullmatch(f.name)
        if m:
            found.setdefault(int(m[1]), {})[int(m[2])] = f
    out = {}
    for save, ranks in found.items():
        if 0 in ranks:
            n = int(read_meta(ranks[0]).get("files", "1"))
            if all(r in ranks for r in range(n)):
                out[save] = [ranks[r] for r in range(n)]
    return out


def read_checkpoint(folder: str | Path) -> dict:
    """The newest complete save of a run folder, as one tree: rank 0's, with every sharded tensor (FSDP2) joined
    from all the save's files along dim 0 in rank order (the whole tensor); ``"state"`` a :class:`State`.
    For readers besides the run (tests, a best-so-far export), also beside a run still saving: a save removed
    while it was being read (a newer one completed) is read again from the newer. Raises TrainingError: no
    complete save, or a file that is not a checkpoint (named)."""
    for _ in range(3):
        try:
            saves = complete_saves(Path(folder))
            if not saves:
                raise TrainingError(f"no complete checkpoint in {folder}")
            files = saves[max(saves)]
            raws = [read_raw(f) for f in files]
        except FileNotFoundError:
            continue
        meta, tensors = raws[0]
        for key in json.loads(meta.get("sharded", "[]")):
            tensors[key] = torch.cat([t[key] for _, t in raws])  # shape: the whole tensor's
        tree = decode_tree(files[0], tensors)
        tree["state"] = State.from_dict(tree["state"])
        return tree
    raise TrainingError(f"{folder}: its newest checkpoint was replaced three times while being read")


class Checkpoint:
    """The checkpoints of this run in ``<scratch_dir>/<key>/`` (module docstring); ``d``: this rank; ``meta``:
    the files' ``"draft"`` entry; ``sharded``: FSDP2, one file a rank (else one file a save, rank 0's)."""

    def __init__(self, scratch_dir: str | Path, key: str, d: Dist, meta: dict, sharded: bool = False):
        self.folder = Path(scratch_dir) / key
        self.d, self.meta, self.sharded = d, meta, sharded
        self.files = d.world if sharded else 1  # files a save
        self.save_no = 0  # the last save written or resumed

    @property
    def path(self) -> Path | None:
        """This rank's file of the last save (rank 0's when not sharded); None before the first."""
        return ckpt_file(self.folder, self.save_no, self.d.rank if self.sharded else 0) if self.save_no else None

    def load(self, draft: torch.nn.Module, opt: torch.optim.Optimizer, sched) -> State:
        """Load the newest complete save into ``draft``, ``opt``, ``sched`` and the global RNGs when a killed run
        left one, returning its State; else a fresh State. Rank 0 creates the folder. Raises TrainingError naming
        the file: not a checkpoint (a pickle, a damaged file: never executed), or one that does not fit this run."""
        saves = complete_saves(self.folder)
        if saves:
            self.save_no = max(saves)
            path = self.path
            tree, meta = read_tree(path)
            if int(meta.get("files", "1")) != self.files:
                raise TrainingError(f"checkpoint {path}: a save of {meta.get('files')} files, this run writes "
                                    f"{self.files}; delete {self.folder} to train from the start")
            try:
                self._restore(tree, draft, opt, sched)
            except (KeyError, IndexError, AttributeError, TypeError, ValueError, RuntimeError) as e:
                raise TrainingError(f"checkpoint {path} does not fit this run's draft and optimizer ({e}); delete "
                                    f"{self.folder} to train from the start") from None
            st = State.from_dict(tree["state"])
            log.info("resumed %s at epoch %d, micro-batch %d, step %d", path, st.epoch, st.micro, st.step)
        else:
            st = State()
        if self.d.main:
            self.folder.mkdir(parents=True, exist_ok=True)
        return st

    @staticmethod
    def _restore(tree: dict, draft: torch.nn.Module, opt: torch.optim.Optimizer, sched) -> None:
        """Saved local shards become DTensors like the live tensors they replace (FSDP2): the draft's by name,
        an optimizer state tensor like its parameter (any of more than 0 dims; ``step`` is a scalar)."""
        live = draft.state_dict()
        draft.load_state_dict({k: like(v, live[k]) for k, v in tree["model"].items()})
        params = [q for g in opt.param_groups for q in g["params"]]
        optim = tree["optimizer"]
        optim["state"] = {i: {k: like(v, params[i]) if v.dim() else v for k, v in s.items()}
                          for i, s in optim["state"].items()}
        opt.load_state_dict(optim)
        sched.load_state_dict(tree["scheduler"])
        set_rng_state(tree["rng"])

    def save(self, draft: torch.nn.Module, opt: torch.optim.Optimizer, sched, st: State) -> None:
        """Write save n + 1 (every rank its file when sharded, else rank 0), wait for every rank, then remove this
        rank's older files."""
        self.save_no += 1
        mine = self.sharded or self.d.main
        if mine:
            model = draft.state_dict()
            tree = {"model": model, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "rng": rng_state(), "state": vars(st), "draft": self.meta}
            sharded = [k for k, v in model.items() if isinstance(v, DTensor)] if st.best_state else []
            best = [f"state/best_state/{k}" for k in sharded]  # local shards too, kept as plain cpu tensors
            write_tree(self.path, tree, {"rank": str(self.d.rank), "files": str(self.files)}, sharded=best)
        barrier(self.d)
        if mine:
            for f in self.folder.glob(f"ckpt-*.rank{self.d.rank if self.sharded else 0}.safetensors"):
                m = NAME.fullmatch(f.name)
                if m and int(m[1]) < self.save_no:
                    f.unlink(missing_ok=True)

    def remove(self) -> None:
        """Delete the run's scratch folder (the draft is written; nothing is left to resume)."""
        shutil.rmtree(self.folder, ignore_errors=True)
