"""What a run reports while it trains: the sums of one optimizer step (:class:`StepStats`), the dvclive curves
(:class:`Curves`) and how much torch.compile has compiled (:func:`compile_stats`).

Curve names: ``train/loss``, ``train/lr``, ``train/loss_step{j}``, ``train/acc_step{j}`` each optimizer step;
``eval/tau_sim``, ``eval/loss``, ``eval/acc_step{j}`` each epoch (j: TTT step); ``best/tau_sim`` once at the end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eaglepipe.train.ttt import TTTResult

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """Sums over the micro-batches of one optimizer step (S = ttt_steps); this rank's until :meth:`reduce`."""

    step_loss: torch.Tensor  # (S,) float, Σ_micro loss_j / grad_accum
    correct: torch.Tensor  # (S,) float, counted positions where draft argmax == target argmax
    counted: torch.Tensor  # (S,) float, counted positions
    loss: torch.Tensor  # () float, Σ_micro weighted loss / grad_accum
    tokens: torch.Tensor  # () float, token positions processed

    @classmethod
    def zeros(cls, steps: int, device) -> "StepStats":
        z = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
        return cls(z(steps), z(steps), z(steps), z(()), z(()))

    def add(self, r: TTTResult, n_tokens: int, grad_accum: int) -> None:
        self.step_loss += r.step_loss / grad_accum
        self.correct += r.correct
        self.counted += r.counted
        self.loss += r.loss.detach() / grad_accum
        self.tokens += n_tokens

    def reduce(self, world: int) -> None:
        """All-reduce over ranks in one call: sums for counts/tokens, means for the losses."""
        if world == 1:
            return
        S = self.step_loss.numel()
        flat = torch.cat([self.step_loss, self.correct, self.counted, self.loss[None], self.tokens[None]])
        dist.all_reduce(flat)
        self.step_loss, self.correct, self.counted = flat[:S] / world, flat[S : 2 * S], flat[2 * S : 3 * S]
        self.loss, self.tokens = flat[3 * S] / world, flat[3 * S + 1]

    def curves(self, lr: float) -> dict[str, float]:
        """The dvclive row of this step: loss, lr, loss and accuracy per TTT step."""
        row = {"train/loss": float(self.loss), "train/lr": lr}
        acc = (self.correct / self.counted.clamp(min=1)).tolist()
        for j, (lj, aj) in enumerate(zip(self.step_loss.tolist(), acc)):
            row[f"train/loss_step{j}"], row[f"train/acc_step{j}"] = lj, aj
        return row


class Curves:
    """dvclive curves whose history lives in the checkpoint: every row logged is appended to ``history`` (the
    :class:`eaglepipe.train.checkpoint.State`'s ``curves`` list, so it is checkpointed), and a new Curves replays
    ``history`` into a fresh dvclive folder, so after a resume the curves show every step from the start even
    when the folder was emptied in between (``dvc repro`` empties outs before a stage runs).
    Writes only on rank 0 (``main``) and when ``live_dir`` is given and dvclive is installed."""

    def __init__(self, live_dir, history: list, main: bool):
        self.live, self.history = None, history
        if live_dir is None or not main:
            return
        try:
            from dvclive import Live
        except ImportError:  # e.g. the GPU image: curves are lost, metrics JSON still written
            log.warning("dvclive is not installed: no training curves in %s", live_dir)
            return
        self.live = Live(str(live_dir), resume=False, save_dvc_exp=False, dvcyaml=None, report=None)
        for step, row in history:
            self._write(step, row)

    def _write(self, step: int, row: dict) -> None:
        self.live.step = step
        for k, v in row.items():
            self.live.log_metric(k, v)
        self.live.next_step()

    def log(self, step: int, row: dict) -> None:
        """One row {name: value} at optimizer step ``step``."""
        self.history.append((step, row))
        if self.live is not None:
            self._write(step, row)

    def end(self, best_tau: float) -> None:
        if self.live is not None:
            self.live.log_metric("best/tau_sim", best_tau, plot=False)
            self.live.end()


def compile_stats() -> tuple[int, float]:
    """(graphs torch.compile has compiled, seconds spent compiling them) in this process so far, from dynamo's
    own counters (``torch._dynamo.utils``: ``counters["stats"]["unique_graphs"]``, the ``_compile.compile_inner``
    timings); (0, 0.0) when nothing was compiled. The seconds are inside the epochs' training and eval seconds
    (the fast path compiles up to 1 + BUCKETS·(steps−1) graphs per grad mode, ttt.flex_rows)."""
    from torch._dynamo.utils import compilation_time_metrics, counters
    return int(counters["stats"]["unique_graphs"]), float(sum(compilation_time_metrics.get("_compile.compile_inner",
                                                                                           [])))
