"""The training loop of the EAGLE-3 draft: :func:`train_drafter`, read top to bottom.

Set-up (:class:`Trainer`'s constructor; steps 1–4 are eaglepipe/train/prepare.py's functions):
 1. index the features (nothing read yet), refuse a sample longer than ``train.batch_tokens``, split train /
    held-out by a hash of (seed, sample id) (packing.py);
 2. the draft's config and vocabulary (the train split's predicted tokens);
 3. the draft, seeded, its lm_head the target's lm_head rows of the draft vocabulary;
 4. 1 byte a token: whether the target's top-1 is in the draft vocabulary (online: the target's capture);
 5. the draft step (TTT unroll; under torchrun DDP-wrapped or FSDP2-sharded, train.parallel) and AdamW with
    warmup + cosine (step.py);
 6. resume from the newest checkpoint in ``<scratch>/<run key>/`` when a killed run with the same key left one
    (checkpoint.py: safetensors + JSON, one file a rank with FSDP2); then, with train.cuda_graph where it applies
    (step.py graph_refusal), the whole optimizer step becomes one CUDA graph per row shape (graphed.py).
The loop, epoch by epoch:
 7. :meth:`Trainer.run_epoch`: the (seed, epoch) rows (packing.py), rank r takes micro-batches r::world
    (distributed.py), an optimizer step every grad_accum micro-batches (:meth:`Trainer.optimizer_step`), a
    checkpoint every checkpoint_every steps;
 8. :meth:`Trainer.end_epoch`: evaluate the held-out samples (evaluation.py), keep the weights with the best
    τ_sim (not the best loss);
 9. write the best draft (eaglepipe.model.draft.save_draft; FSDP2: gathered whole, written by rank 0) and return
    :meth:`Trainer.summary`.

Bad data never becomes a draft: a sample with non-finite features stops training naming it and its shard
(stream.py); a non-finite loss or gradient norm stops before the optimizer step, naming the step's samples,
with the checkpoint of the last good step left in place (TrainingError; in a CUDA graph the update of that step
is skipped on the device, fused AdamW's found_inf).
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.utils import clip_grad_norm_

from eaglepipe.data.features import FeatureSet, SampleRef
from eaglepipe.errors import TrainingError
from eaglepipe.model.draft import Eagle3Draft, n_params, save_draft
from eaglepipe.model.target_head import load_target_head
from eaglepipe.params import TrainParams
from eaglepipe.target.config import read_target_config
from eaglepipe.train.checkpoint import Checkpoint, checkpoint_key
from eaglepipe.train.curves import Curves, StepStats, compile_stats
from eaglepipe.train.distributed import Dist, barrier, full, init_distributed, like, local, pick_device
from eaglepipe.train.evaluation import evaluate
from eaglepipe.train.packing import epoch_rows, padding_fraction, steps_per_epoch, total_steps
from eaglepipe.train.prepare import draft_config, draft_vocab, index_features, init_draft, online_capture, top1_in_vocab
from eaglepipe.train.step import DraftStep, graph_refusal, make_optimizer
from eaglepipe.train.stream import Samples

log = logging.getLogger(__name__)


def train_drafter(
    features_dir: str | Path,
    target_dir: str | Path,
    out_dir: str | Path,
    p: TrainParams,
    *,
    scratch_dir: str | Path,
    live_dir: str | Path | None = None,
    stop_after: int | None = None,
) -> dict:
    """Train, keep the best epoch by τ_sim, write ``out_dir`` (draft.save_draft), return the summary dict
    (:meth:`Trainer.summary` + ``losses``, the train loss of every optimizer step).

    scratch_dir: where the ``<run key>/`` checkpoint folder lives (outside DVC outs, so a killed run resumes).
    live_dir: dvclive folder (None: no dvclive).
    stop_after: stop (as if killed) right after the checkpoint of this optimizer step (tests); returns
    ``{"stopped_at", "losses"}``.
    Raises TrainingError (non-finite features or loss: the checkpoint of the last good step is kept; a sample
    longer than train.batch_tokens; a checkpoint file that is not one, or does not fit this run, named),
    FeatureStoreError (a damaged shard, a store of the other kind), CaptureMismatch, EaglepipeError (features of
    another target, < 2 samples, no full step per epoch).
    """
    d = init_distributed()
    trainer = Trainer(Path(features_dir), Path(target_dir), p, d, pick_device(d), Path(scratch_dir), live_dir)
    st = trainer.st
    log.info("draft: %d trainable parameters, %d optimizer steps, device %s, world %d",
             n_params(trainer.draft), trainer.total_steps, trainer.device, d.world)
    while st.epoch < p.epochs:
        if trainer.run_epoch(stop_after):
            return {"stopped_at": st.step, "losses": st.losses}
        trainer.end_epoch()
    summary = trainer.summary()
    trainer.write_best(out_dir)
    barrier(d)
    summary["losses"] = st.losses
    return summary


class Trainer:
    """One rank's run, built by steps 1–6: its samples, the draft step, optimizer and schedule, checkpoint, the
    curves, and ``st`` (:class:`eaglepipe.train.checkpoint.State`: every counter and history the loop advances,
    the one thing its methods change besides the weights and optimizer). Raises like :func:`train_drafter`."""

    def __init__(self, features_dir: Path, target_dir: Path, p: TrainParams, d: Dist, device: torch.device,
                 scratch_dir: Path, live_dir: Path | None):
        self.p, self.d, self.device = p, d, device
        target_cfg, head = read_target_config(target_dir), load_target_head(target_dir)
        cfg = draft_config(target_cfg, len(FeatureSet(features_dir).layers), p)
        fs, train, held = index_features(features_dir, p, cfg.target_hidden_size)  # 1
        vocab, vstats = draft_vocab(fs, train, held, cfg.vocab_size, p.draft_vocab_size)  # 2
        self.draft = init_draft(cfg, vocab, head.lm_head, p.seed, device)  # 3
        head = head.to(device)
        capture = online_capture(target_dir, fs, device, p)  # 4
        inv = top1_in_vocab(head, features_dir, fs.refs, self.draft.t2d, p.batch_tokens, capture)
        on_cuda = device.type == "cuda"
        self.samples = Samples(features_dir, train, held, inv, capture, pin=on_cuda,
                               side_stream=p.capture_stream and on_cuda)
        self.draft.lm_head.weight.requires_grad_(not p.freeze_lm_head)  # 5
        self.draft_step = DraftStep(self.draft, head.draft_rows(self.draft.t2d), p, device, d.world)
        self.total_steps = total_steps(self.samples.lengths, p, d.world)
        self.opt, self.sched = make_optimizer(self.draft, p, device, self.total_steps)
        self.extra = {"layers": fs.layers, "target": str(target_dir)}  # config.json's entries besides the draft's
        self.about = {"draft": cfg.to_dict(), "layers": fs.layers, "store": fs.store, "vocab": vstats,
                      "samples": {"train": len(train), "eval": len(held)}}  # the summary's fixed part
        key = checkpoint_key(p, fs.manifest, len(fs), target_cfg, d.world)
        self.ckpt = Checkpoint(scratch_dir, key, d, meta={"config": cfg.to_dict(), "extra": self.extra,
                                                          "epochs": p.epochs}, sharded=self.draft_step.sharded)
        self.st = self.ckpt.load(self.draft, self.opt, self.sched)  # 6
        self.resumed_from = self.st.step
        why_eager = graph_refusal(p, device, d.world)
        if why_eager is None:
            self.draft_step.use_graph(self.opt, p.grad_clip)
        elif p.fast and device.type == "cuda":
            log.info("the eager fast step runs: %s", why_eager)
        self.curves = Curves(live_dir, self.st.curves, d.main)

    def run_epoch(self, stop_after: int | None) -> bool:
        """7: this rank's micro-batches of epoch ``st.epoch`` from ``st.micro`` on; True when it stopped (as if
        killed) right after the checkpoint of optimizer step ``stop_after``."""
        p, d, st = self.p, self.d, self.st
        rows = epoch_rows(self.samples.lengths, p.seed, st.epoch, p.batch_tokens, p.packing)
        if st.micro == 0:
            st.padding.append(padding_fraction(self.samples.lengths, rows, p.batch_tokens))
        n_micro = steps_per_epoch(len(rows), d.world, p.grad_accum) * p.grad_accum
        mine = [[self.samples.train[i] for i in row] for row in rows[d.rank :: d.world][:n_micro]]
        t0, stats, step_rows = time.time(), StepStats.zeros(p.ttt_steps, self.device), []
        graphed = self.draft_step.graph is not None
        for refs, b in self.samples.stream(mine[st.micro :]):
            last_micro = (st.micro + 1) % p.grad_accum == 0
            if graphed:  # forward, backward and the optimizer's update in one replay (grad_accum 1)
                r = self.draft_step.graphed_training(b)
            else:
                with self.draft_step.no_sync() if not last_micro else nullcontext():
                    r = self.draft_step.training(b)
                    (r.loss / p.grad_accum).backward()
            stats.add(r, b.input_ids.numel(), p.grad_accum)
            step_rows.append(refs)
            st.micro += 1
            if not last_micro:
                continue
            self.optimizer_step(stats, step_rows)
            stats, step_rows = StepStats.zeros(p.ttt_steps, self.device), []
            if st.step % p.checkpoint_every == 0 or st.step == stop_after:
                st.seconds, t0 = st.seconds + time.time() - t0, time.time()
                self.save()
            if st.step == stop_after:
                log.info("stopping after step %d (stop_after)", st.step)
                return True
        st.seconds += time.time() - t0
        return False

    def optimizer_step(self, stats: StepStats, rows: list[list[SampleRef]]) -> None:
        """Reduce the step's stats, refuse a non-finite loss or gradient, clip, step, schedule, log a curve row.
        In a CUDA graph the clipping and the update already ran in the replay (skipped there when non-finite)."""
        stats.reduce(self.d.world)
        graph = self.draft_step.graph is not None
        norm = self.draft_step.grad_norm if graph else clip_grad_norm_(self.draft.parameters(), self.p.grad_clip)
        loss, grad_norm = float(stats.loss), float(full(norm))
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise self.non_finite(rows, loss, grad_norm)
        if not graph:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.st.step += 1
        self.st.tokens += int(stats.tokens)
        self.st.losses.append(loss)
        self.curves.log(self.st.step, stats.curves(float(self.sched.get_last_lr()[0])))

    def end_epoch(self) -> None:
        """8: evaluate, log, keep the weights if τ_sim is the best so far, move to the next epoch, checkpoint."""
        st, t0 = self.st, time.time()
        ev = evaluate(self.samples, self.draft_step, self.p.batch_tokens, self.p.ttt_steps)
        ev["epoch"], ev["step"] = st.epoch, st.step
        ev["seconds"] = st.seconds - sum(e.get("seconds", 0.0) for e in st.evals)  # this epoch's training loop
        st.evals.append(ev)
        self.log_epoch(ev, t0)
        row = {"eval/tau_sim": ev["tau_sim"], "eval/loss": ev["loss"]}
        row.update({f"eval/acc_step{j}": a for j, a in enumerate(ev["acc"])})
        self.curves.log(st.step, row)
        if ev["tau_sim"] > st.best_tau:
            st.best_tau, st.best_epoch, st.best_acc = ev["tau_sim"], st.epoch, ev["acc"]
            st.best_state = {k: local(v).detach().cpu().clone() for k, v in self.draft.state_dict().items()}
        st.epoch, st.micro = st.epoch + 1, 0
        self.save()

    def save(self) -> None:
        self.ckpt.save(self.draft, self.opt, self.sched, self.st)

    def write_best(self, out_dir: Path) -> None:
        """9 (every rank calls it; rank 0 writes): the best epoch's weights to ``out_dir`` (config.json +
        model.safetensors), the curves closed, the scratch folder removed. FSDP2: the shards are gathered into
        a whole draft first (an all-gather per tensor), written as one process writes it."""
        live = self.draft.state_dict()
        self.draft.load_state_dict({k: like(v, live[k]) for k, v in self.st.best_state.items()})
        whole = {k: full(v) for k, v in self.draft.state_dict().items()}  # FSDP2: all-gathers, on every rank
        if not self.d.main:
            return
        draft = self.draft
        if self.draft_step.sharded:
            draft = Eagle3Draft(self.draft.cfg)
            draft.load_state_dict(whole)
        save_draft(draft, Path(out_dir), extra={**self.extra, "best_tau_sim": self.st.best_tau,
                                                "best_epoch": self.st.best_epoch})
        self.curves.end(self.st.best_tau)
        self.ckpt.remove()

    def log_epoch(self, ev: dict, t0: float) -> None:
        st, (graphs, compiling) = self.st, compile_stats()
        log.info("epoch %d: eval loss %.4f, acc %s, tau_sim %.3f (training %.0f s so far, %.0f tok/s; eval %.1f s; "
                 "%d graphs compiled in %.0f s so far)", st.epoch, ev["loss"], [round(a, 3) for a in ev["acc"]],
                 ev["tau_sim"], st.seconds, st.tokens / st.seconds if st.seconds else 0.0, time.time() - t0, graphs,
                 compiling)

    def non_finite(self, rows: list[list[SampleRef]], loss: float, grad_norm: float) -> TrainingError:
        names = ", ".join(f"{r.id!r} ({r.shard})" for row in rows for r in row)
        path = self.ckpt.path
        kept = f"the last good checkpoint {path} is kept" if path else "no checkpoint was written yet"
        return TrainingError(
            f"non-finite training loss {loss} (grad norm {grad_norm}) at optimizer step {self.st.step + 1}, epoch "
            f"{self.st.epoch}, rank {self.d.rank}; its micro-batches held samples {names} (their features are "
            f"finite); nothing of this step was applied and {kept}. Lower train.lr or check those samples")

    def summary(self) -> dict:
        """9: the metrics dict (flat per-step accuracies for dvc)."""
        st = self.st
        per_step = lambda acc: {f"step{j}": round(a, 4) for j, a in enumerate(acc)}  # noqa: E731
        return {
            **self.about,
            "train_tokens": st.tokens,
            "steps": st.step,
            "seconds": round(st.seconds, 2),
            "tokens_per_s": round(st.tokens / st.seconds, 1) if st.seconds else 0.0,
            "padding_fraction": round(sum(st.padding) / max(1, len(st.padding)), 4),
            "best": {"epoch": st.best_epoch, "tau_sim": round(st.best_tau, 4), "acc": per_step(st.best_acc)},
            "oov_top1": round(st.evals[-1]["oov_top1"], 4),
            "evals": {f"epoch{e['epoch']}": {"tau_sim": round(e["tau_sim"], 4), "loss": round(e["loss"], 4),
                                             "acc": per_step(e["acc"])} for e in st.evals},
            "epoch_seconds": [round(e.get("seconds", 0.0), 2) for e in st.evals],  # each epoch's training loop
            "final_train_loss": st.losses[-1] if st.losses else None,
            "device": str(self.device),
            "cuda_graphs": len(self.draft_step.graph.graphs) if self.draft_step.graph else 0,  # 0: the eager step
            "world_size": self.d.world,
            "resumed_from_step": self.resumed_from,
        }
