"""Each epoch's evaluation: the TTT unroll on the held-out samples, summarised as per-step accuracy and τ_sim.

τ_sim (:func:`eaglepipe.train.ttt.tau_sim`) = 1 + Σ_k Π_{i≤k} acc_i: the acceptance length a chain of
``ttt_steps`` drafted tokens would reach if each step were accepted with its held-out accuracy. The loop keeps
the weights of the epoch with the best τ_sim, not the best loss.
"""

from __future__ import annotations

import torch

from eaglepipe.train.packing import pack
from eaglepipe.train.step import DraftStep
from eaglepipe.train.stream import Samples
from eaglepipe.train.ttt import tau_sim


def evaluate(samples: Samples, step: DraftStep, batch_tokens: int, ttt_steps: int) -> dict:
    """TTT on ``samples.held`` (packed greedily in their order into rows of ≤ ``batch_tokens``), through
    :meth:`DraftStep.evaluation`: :func:`eval_summary`'s dict. Nothing is backpropagated; on CUDA with
    ``train.fast`` the unroll still runs with autograd on, because dynamo guards on the grad mode: the training
    step's compiled graphs then serve the evaluation instead of a second set compiled for no-grad. Elsewhere
    under no_grad."""
    held = samples.held
    rows = pack([r.n_tokens for r in held], list(range(len(held))), batch_tokens)
    batches = samples.stream([[held[i] for i in row] for row in rows])
    with torch.set_grad_enabled(step.fast and step.device.type == "cuda"):
        return eval_summary((step.evaluation(b) for _, b in batches), ttt_steps)


def eval_summary(results, steps: int) -> dict:
    """Held-out TTTResults (one per packed row) → {"loss": mean over rows, "acc": [S] accuracy per TTT step over
    counted positions, "tau_sim", "oov_top1": share of counted positions whose target top-1 is outside the draft
    vocabulary, "positions": counted positions of step 0} (:func:`evaluate`; benchmarks/sim_gap.py on other
    samples)."""
    correct, counted, trained = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    loss, n = 0.0, 0
    for r in results:
        correct += r.correct.cpu()
        counted += r.counted.cpu()
        trained += r.trained.cpu()
        loss, n = loss + float(r.loss.detach()), n + 1
    acc = (correct / counted.clamp(min=1)).tolist()
    return {
        "loss": loss / max(n, 1),
        "acc": acc,
        "tau_sim": tau_sim(acc),
        "oov_top1": float(1 - trained[0] / counted[0].clamp(min=1)),
        "positions": int(counted[0]),
    }
