"""The draft vocabulary: which target tokens the draft can propose, and the d2t / t2d tables engines load.

Id spaces: a *target id* indexes the target's vocabulary [0, V); a *draft id* indexes the draft's lm_head rows
[0, Vd). Draft ids are the chosen target ids sorted ascending, so draft id i ↔ the i-th smallest chosen target id
and ``t2d`` boolean indexing (``x[..., t2d]``) yields columns already in draft-id order.

- ``d2t`` int64 (Vd,): offsets, target id = draft id + d2t[draft id] (a full-vocab draft has d2t all zeros).
- ``t2d`` bool (V,): t2d[target id] = the token has a draft id.

Choice: the Vd most frequent *predicted* tokens of the training split, i.e. input_ids[t+1] wherever
loss_mask[t] (the tokens the loss trains the draft to produce). Ties break by lower target id first. When fewer
than Vd distinct tokens occur, the rest are the lowest target ids not chosen yet — the same rule, since every
unseen token ties at count 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch

from eaglepipe.data.features import FeatureSample

log = logging.getLogger(__name__)


@dataclass
class DraftVocab:
    target_ids: torch.Tensor  # int64 (Vd,), ascending: target_ids[draft id] = target id
    vocab_size: int  # V

    @property
    def size(self) -> int:
        return int(self.target_ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        """int64 (Vd,) offsets: target id = draft id + d2t[draft id]."""
        return self.target_ids - torch.arange(self.size, dtype=torch.int64)  # (Vd,)

    @property
    def t2d(self) -> torch.Tensor:
        """bool (V,): target id is in the draft vocabulary."""
        m = torch.zeros(self.vocab_size, dtype=torch.bool)  # (V,)
        m[self.target_ids] = True
        return m


def count_predicted_tokens(samples: Iterable[FeatureSample], vocab_size: int) -> torch.Tensor:
    """int64 (V,): how often each target id is a trained prediction (input_ids[t+1] where loss_mask[t])."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)  # (V,)
    for s in samples:
        nxt = s.input_ids[1:][s.loss_mask[:-1].bool()]  # (n,) predicted tokens
        counts += torch.bincount(nxt.long(), minlength=vocab_size)[:vocab_size]
    return counts


def build_draft_vocab(counts: torch.Tensor, size: int) -> DraftVocab:
    """Top-``size`` target ids by count (ties: lower id first), returned ascending. size ≥ V gives the full vocab."""
    V = counts.numel()
    size = min(size, V)
    # stable sort on -count keeps ascending id order among equal counts: the tie-break
    order = torch.sort(-counts, stable=True).indices  # (V,) ids by count desc, id asc
    chosen = torch.sort(order[:size]).values  # (Vd,) ascending target ids
    return DraftVocab(target_ids=chosen, vocab_size=V)


def vocab_stats(counts: torch.Tensor, vocab: DraftVocab) -> dict:
    """Coverage of the trained predictions by the draft vocabulary (reported in the training json)."""
    total = int(counts.sum())
    covered = int(counts[vocab.target_ids].sum())
    return {
        "draft_vocab_size": vocab.size,
        "target_vocab_size": vocab.vocab_size,
        "distinct_predicted_tokens": int((counts > 0).sum()),
        "predicted_tokens": total,
        "coverage": covered / total if total else 0.0,
    }
