"""The reference speculative decoder: output = plain greedy; controls τ = k+1 (target as draft), τ ≈ 1 (random)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from eaglepipe.model.draft import DraftConfig, Eagle3Draft
from eaglepipe.serving.specdec import Eagle3Drafter, SpecStats, Target, greedy_generate, speculative_generate

PROMPTS = [[5, 17, 33, 2, 90, 4], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18]]
EOS: set[int] = set()  # no EOS: every decode runs to max_new_tokens


class TargetAsDrafter:
    """Control: the target itself drafts (greedy, own KV cache), so every draft is accepted."""

    def __init__(self, model):
        self.model, self.cache, self.n = model, DynamicCache(), 0

    def _fwd(self, ids):
        return self.model(input_ids=torch.tensor([ids]), past_key_values=self.cache, use_cache=True).logits[0, -1]

    def extend(self, tokens, aux, next_tokens):
        self._fwd(tokens)
        self.n += len(tokens)
        self.pending = next_tokens[-1]
        first = int(self._fwd([self.pending]).argmax())
        self.cache.crop(self.n)
        return first

    def chain(self, first, k):
        out = [first]
        logits = self._fwd([self.pending, first])
        while len(out) < k:
            out.append(int(logits.argmax()))
            logits = self._fwd([out[-1]])
        self.cache.crop(self.n)
        return out


@pytest.fixture(scope="module")
def model(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def random_drafter(model, tiny_target, seed=0):
    torch.manual_seed(seed)
    cfg = DraftConfig.from_target(json.loads((tiny_target / "config.json").read_text()), n_aux=3,
                                  draft_vocab_size=99)
    draft = Eagle3Draft(cfg).eval()
    return Eagle3Drafter(draft, model.model.embed_tokens.weight.detach())


@pytest.mark.parametrize("k", [1, 3, 5])
def test_target_as_its_own_draft_accepts_everything(model, k):
    total = SpecStats(k)
    for p in PROMPTS:
        with torch.no_grad():
            out, st = speculative_generate(Target(model, [1, 2, 3]), TargetAsDrafter(model), p, k, 1 + 4 * (k + 1), EOS)
        ref, _ = greedy_generate(model, p, 1 + 4 * (k + 1), EOS)
        assert out == ref
        total += st
    assert total.tau == k + 1 and total.acceptance_per_pos == [1.0] * k and total.rounds == 12


def test_random_draft_equals_greedy_and_tau_near_one(model, tiny_target):
    k, total = 3, SpecStats(3)
    for i, p in enumerate(PROMPTS):
        drafter = random_drafter(model, tiny_target, seed=i)
        out, st = speculative_generate(Target(model, [1, 2, 3]), drafter, p, k, 24, EOS)
        ref, _ = greedy_generate(model, p, 24, EOS)
        assert out == ref and len(out) == 24
        total += st
    assert 1.0 <= total.tau < 1.3
    assert total.acceptance_per_pos[0] < 0.3 and total.acceptance_per_pos == sorted(total.acceptance_per_pos, reverse=True)
    assert total.emitted == total.rounds + sum(total.accepted_per_pos)


def test_eos_stops_and_matches_greedy(model, tiny_target):
    p = PROMPTS[0]
    ref, _ = greedy_generate(model, p, 30, EOS)
    eos = {ref[7]}  # pretend the 8th greedy token is EOS
    ref_eos, _ = greedy_generate(model, p, 30, eos)
    out, _ = speculative_generate(Target(model, [1, 2, 3]), TargetAsDrafter(model), p, 4, 30, eos)
    assert out == ref_eos and out[-1] in eos and len(out) == ref.index(ref[7]) + 1
