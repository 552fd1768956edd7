"""A reference speculative decoder in plain torch: HF target + a drafter, chain drafts, greedy verification.

It exists so that acceptance length τ can be measured on any machine, with the same draft the engines load.
Batch size 1, greedy. One round, with P tokens already in the target's KV cache and ``x`` pending::

    draft:   d1 .. dk                         (k chained draft steps)
    target:  forward [x, d1, .., dk]  → greedy y0 .. yk   (y_i = target's next token after d_i; y0 after x)
    accept:  a = longest prefix with d_{i+1} == y_i  (0 ≤ a ≤ k)
    emit:    d1 .. da, ya                     (a + 1 tokens: the bonus token ya is the target's own)

Every emitted token is the target's greedy choice, so the output equals plain greedy decoding token for
token. τ = mean of (a + 1) over rounds = tokens emitted per target forward (prefill not counted);
acceptance at draft position i = rounds whose d_i was accepted / rounds (vLLM's
``num_accepted_tokens_per_pos / num_drafts``).

EAGLE-3 alignment (eaglepipe/train/ttt/unroll.py): draft position t reads (g_t, x_{t+1}) — the target's aux
states at t and the token after it — and predicts x_{t+2}. After a round the draft is re-fed the target's states
g for the verified positions [x, d1..da] paired with the next tokens [d1..da, ya], replacing its own guesses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eaglepipe.engines.hf import boundary_hooks
from eaglepipe.model.draft import Eagle3Draft, KVCache, draft_step
from eaglepipe.target.hf_model import decoder


@dataclass
class SpecStats:
    """Counters of one or more decodes (add with ``+=``)."""

    k: int
    rounds: int = 0
    emitted: int = 0  # tokens emitted by rounds (a + 1 each)
    accepted_per_pos: list[int] = field(default_factory=list)
    seconds: float = 0.0
    new_tokens: int = 0  # tokens returned (prefill token included, cut at max_new_tokens / EOS)

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.k

    def __iadd__(self, o: "SpecStats") -> "SpecStats":
        self.rounds += o.rounds
        self.emitted += o.emitted
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, o.accepted_per_pos)]
        self.seconds += o.seconds
        self.new_tokens += o.new_tokens
        return self

    def add_round(self, a: int) -> None:
        """One verify step whose first ``a`` drafts were accepted (``a + 1`` tokens emitted)."""
        self.rounds += 1
        self.emitted += a + 1
        for i in range(a):
            self.accepted_per_pos[i] += 1

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens per target forward, bonus token included (1 ≤ τ ≤ k + 1)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_per_pos(self) -> list[float]:
        return [a / self.rounds if self.rounds else 0.0 for a in self.accepted_per_pos]

    def to_dict(self) -> dict:
        return {"k": self.k, "tau": self.tau, "acceptance_per_pos": self.acceptance_per_pos, "rounds": self.rounds,
                "new_tokens": self.new_tokens, "seconds": self.seconds,
                "tokens_per_s": self.new_tokens / self.seconds if self.seconds else 0.0}


class Target:
    """An HF causal LM with a KV cache whose forwards also return the aux states h[k], k in ``layers``."""

    def __init__(self, model, layers: list[int]):
        self.model, self.layers = model, layers
        self.blocks = decoder(model).layers

    @torch.inference_mode()
    def forward(self, ids: list[int], cache) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: T new tokens after the cached ones → (logits (T, V) float32, aux (T, L, Ht) float32)."""
        dev = self.model.device
        with boundary_hooks(self.blocks, self.layers) as got:
            out = self.model(input_ids=torch.tensor([ids], device=dev), past_key_values=cache, use_cache=True)
        aux = torch.stack([got[k][0] for k in self.layers], dim=1)  # (T, L, Ht)
        return out.logits[0].float(), aux


class Eagle3Drafter:
    """Drives an :class:`Eagle3Draft` with its own KV cache (one position per verified target position)."""

    def __init__(self, draft: Eagle3Draft, embed_tokens: torch.Tensor):
        self.draft, self.embed = draft, embed_tokens
        self.cache = KVCache()
        self.hidden = None  # (1, 1, H) the last verified position's output
        self.pos = 0
        self.dtype = next(draft.parameters()).dtype
        self.dev = embed_tokens.device

    def extend(self, tokens: list[int], aux: torch.Tensor, next_tokens: list[int]) -> int:
        """Feed T verified positions: their aux (T, L, Ht) paired with the tokens after them (``next_tokens``).

        ``tokens`` (the positions' own tokens) is part of the drafter API but unused by EAGLE-3, whose input
        at position t is (g_t, x_{t+1}). Returns the first draft token of the next round.
        """
        T = aux.shape[0]
        pos = torch.arange(self.pos, self.pos + T, device=self.dev)[None]  # (1, T)
        ids = torch.tensor([next_tokens], device=self.dev)  # (1, T)
        st = draft_step(self.draft, self.embed, ids, pos, self.cache, aux=aux[None].to(self.dtype))
        self.pos += T
        self.hidden = st.hidden[:, -1:]  # (1, 1, H)
        return int(st.logits[0, -1].argmax())

    def chain(self, first: int, k: int) -> list[int]:
        """Draft k tokens starting with ``first`` (already predicted); the cache grows by k-1 guesses."""
        out, hidden, tok = [first], self.hidden, first
        for i in range(k - 1):
            pos = torch.tensor([[self.pos + i]], device=self.dev)
            tok_t = torch.tensor([[tok]], device=self.dev)
            st = draft_step(self.draft, self.embed, tok_t, pos, self.cache, hidden=hidden)
            hidden, tok = st.hidden, int(st.logits[0, -1].argmax())
            out.append(tok)
        self.cache.crop(self.pos)  # drop the guesses; verified positions are re-fed by extend()
        return out


@torch.inference_mode()
def speculative_generate(target: Target, drafter, prompt: list[int], k: int, max_new_tokens: int,
                         eos_ids: set[int], rounds: list[tuple[int, int]] | None = None,
                         ) -> tuple[list[int], SpecStats]:
    """Greedy speculative decoding of one prompt. ``drafter``: an :class:`Eagle3Drafter` (or the same API).

    Returns the new tokens (≤ max_new_tokens, ending at the first EOS if any) and the round counters. ``rounds``,
    when given, gets one ``(s, a)`` a round: the index in the returned tokens that its first drafted token
    proposed, and how many of its drafts were accepted (:func:`split_rounds` counts them by region).
    """
    from transformers import DynamicCache

    stats = SpecStats(k)
    t0 = time.perf_counter()
    cache = DynamicCache()
    logits, aux = target.forward(prompt, cache)
    x = int(logits[-1].argmax())
    out = [x]
    d_first = drafter.extend(prompt, aux, prompt[1:] + [x])
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        drafts = drafter.chain(d_first, k)
        n_cached = cache.get_seq_length()
        logits, aux = target.forward([x] + drafts, cache)
        y = logits.argmax(-1).tolist()  # (k+1,) y_i = greedy token after [x, d1..dk][i]
        a = 0
        while a < k and drafts[a] == y[a]:
            a += 1
        stats.add_round(a)
        if rounds is not None:
            rounds.append((len(out), a))
        new = drafts[:a] + [y[a]]
        cache.crop(n_cached + a + 1)  # keep x, d1..da
        d_first = drafter.extend([x] + drafts[:a], aux[: a + 1], new)
        out += new
        x = y[a]
    eos = next((i for i, t in enumerate(out) if t in eos_ids), None)
    out = out[: min(max_new_tokens, eos + 1 if eos is not None else len(out))]
    stats.seconds = time.perf_counter() - t0
    stats.new_tokens = len(out)
    return out, stats


def split_rounds(rounds: list[tuple[int, int]], inside: list[bool], k: int) -> dict[str, SpecStats]:
    """:func:`speculative_generate`'s ``rounds`` of one decode, counted by where each round's first drafted token
    landed: ``{"reasoning": SpecStats, "answer": SpecStats}``; ``inside[i]``: output token ``i`` is reasoning
    (a round proposing past the last token counts where the last token is)."""
    out = {"reasoning": SpecStats(k), "answer": SpecStats(k)}
    for s, a in rounds:
        out["reasoning" if inside and inside[min(s, len(inside) - 1)] else "answer"].add_round(a)
    return out


@torch.inference_mode()
def greedy_generate(model, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], float]:
    """Plain greedy decoding with a KV cache, one token per forward (the baseline). Returns (tokens, seconds)."""
    from transformers import DynamicCache

    t0 = time.perf_counter()
    cache, out, ids = DynamicCache(), [], prompt
    while len(out) < max_new_tokens and (not out or out[-1] not in eos_ids):
        logits = model(input_ids=torch.tensor([ids], device=model.device), past_key_values=cache, use_cache=True).logits
        out.append(int(logits[0, -1].argmax()))
        ids = out[-1:]
    return out, time.perf_counter() - t0
