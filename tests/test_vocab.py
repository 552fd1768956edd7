"""Draft vocabulary: counting the trained predictions, top-k with the id tie-break, d2t offsets, t2d mask."""

import torch

from eaglepipe.data.features import FeatureSample
from eaglepipe.model.vocab import build_draft_vocab, count_predicted_tokens, vocab_stats


def _sample(ids, mask):
    T = len(ids)
    return FeatureSample("s", torch.tensor(ids), torch.tensor(mask, dtype=torch.bool),
                         torch.zeros(T, 1, 2), torch.zeros(T, 2))


def test_counts_only_predicted_tokens_under_the_mask():
    # ids   5 3 3 7 3 5 ; mask[t] = ids[t+1] is trained: t=1..4 → predicted ids[2..5] = 3 7 3 5
    s = _sample([5, 3, 3, 7, 3, 5], [0, 1, 1, 1, 1, 0])
    counts = count_predicted_tokens([s, s], vocab_size=10)
    assert counts.tolist() == [0, 0, 0, 4, 0, 2, 0, 2, 0, 0]


def test_top_k_tie_break_and_tables():
    counts = torch.tensor([0, 0, 0, 4, 0, 2, 0, 2, 0, 0])
    v = build_draft_vocab(counts, 2)  # 3 (4), then 5 and 7 tie at 2: lower id 5 wins
    assert v.target_ids.tolist() == [3, 5]
    assert v.d2t.tolist() == [3, 4]
    assert v.t2d.tolist() == [False, False, False, True, False, True, False, False, False, False]
    v = build_draft_vocab(counts, 3)
    assert v.target_ids.tolist() == [3, 5, 7]
    assert v.d2t.tolist() == [3, 4, 5]
    assert v.d2t.dtype == torch.int64 and v.t2d.dtype == torch.bool


def test_fill_with_lowest_unused_ids_when_too_few_distinct_tokens():
    counts = torch.tensor([0, 0, 0, 4, 0, 2, 0, 2, 0, 0])
    v = build_draft_vocab(counts, 5)  # 3 distinct seen; then 0 and 1 (lowest unseen ids)
    assert v.target_ids.tolist() == [0, 1, 3, 5, 7]
    assert v.d2t.tolist() == [0, 0, 1, 2, 3]
    s = vocab_stats(counts, v)
    assert s["coverage"] == 1.0 and s["distinct_predicted_tokens"] == 3 and s["predicted_tokens"] == 8


def test_full_vocab_has_zero_offsets_and_round_trips():
    counts = torch.randint(0, 5, (12,))
    v = build_draft_vocab(counts, 50)  # larger than V → all of V
    assert v.size == 12 and v.d2t.tolist() == [0] * 12 and bool(v.t2d.all())
    v = build_draft_vocab(counts, 7)
    assert (torch.arange(7) + v.d2t).tolist() == v.target_ids.tolist()  # target = draft + d2t[draft]
    assert v.t2d.nonzero().flatten().tolist() == v.target_ids.tolist()  # t2d order = draft-id order
