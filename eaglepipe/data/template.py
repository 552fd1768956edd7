"""Chat template → token ids and the loss mask.

The loss mask is over *predictions*: ``loss_mask[t] = 1`` iff token ``t+1`` (the token predicted from
position t) lies inside an assistant turn. A public bug left the mask unshifted (1 where token t itself is
assistant text), so the first assistant token — the one drafted right after the prompt — was never trained::

    tokens      <im_start>assistant\\n  Hello   there  <im_end>
    assistant?      0        0     0     1       1       1
    loss_mask       0        0     1     1       1       0      (the last position predicts nothing)

An assistant turn spans its content and the template's end-of-turn marker (the draft must learn to stop),
not the ``<|im_start|>assistant\\n`` header, which the template writes. Spans are found on the rendered
text: ``render(msgs[:i], add_generation_prompt=True)`` ends where assistant turn i starts and
``render(msgs[:i+1])`` ends just after it (trailing whitespace dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglepipe.errors import CaptureMismatch


@dataclass
class Tokenized:
    """input_ids int64 (T,); loss_mask bool (T,); assistant bool (T,) (token t is assistant text)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    assistant: torch.Tensor


def _render(tok, messages: list[dict], gen_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)


def assistant_spans(tok, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character spans of its assistant turns.

    Raises CaptureMismatch when the template is not prefix-stable (rendering a prefix does not give a
    prefix of the full text), since then no span can be trusted.
    """
    full = _render(tok, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render(tok, messages[:i], True)
        upto = _render(tok, messages[: i + 1], False).rstrip()
        if not (full.startswith(head) and full.startswith(upto) and len(upto) > len(head)):
            raise CaptureMismatch(
                f"chat template is not prefix-stable at message {i}: cannot locate the assistant turn"
            )
        spans.append((len(head), len(upto)))
    return full, spans


def tokenize_conversation(tok, messages: list[dict], max_length: int) -> Tokenized:
    """Render ``messages`` with the tokenizer's chat template and build the shifted loss mask.

    Args:
        tok: a fast HF tokenizer with a chat template (offset mapping is needed).
        messages: [{"role": "system"|"user"|"assistant", "content": str}, ...].
        max_length: sequences are cut to this many tokens.
    Returns:
        :class:`Tokenized` with tensors of length T ≤ max_length.
    """
    text, spans = assistant_spans(tok, messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:max_length]
    starts = [a for a, _ in enc["offset_mapping"][:max_length]]
    assistant = torch.tensor([any(s <= c < e for s, e in spans) for c in starts], dtype=torch.bool)
    loss_mask = torch.zeros_like(assistant)
    loss_mask[:-1] = assistant[1:]
    return Tokenized(torch.tensor(ids, dtype=torch.int64), loss_mask, assistant)


def generation_prompt(tok, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` followed by the template's assistant header (what the target completes)."""
    return tok(_render(tok, messages, True), add_special_tokens=False)["input_ids"]


_QUERY = "\x00eaglepipe-user-turn\x00"  # a sentinel no template writes


def user_prompt(tok, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` followed by the template's user header: what the target completes to write a
    user turn itself (Magpie's pre-query template, arXiv:2406.08464 §2.1), e.g. SmolLM2's
    ``<|im_start|>system\\n…<|im_end|>\\n<|im_start|>user\\n`` for no messages (its default system turn included).

    Raises CaptureMismatch when the template renders no user header before the turn's content (the template
    drops or rewrites an unexpected user message), since then there is no prefix to complete.
    """
    text = _render(tok, [*messages, {"role": "user", "content": _QUERY}], False)
    head, found, _ = text.partition(_QUERY)
    if not found or not head:
        raise CaptureMismatch("chat template renders no user header before a user turn's content: the target "
                              "cannot write user turns (prompts.synthetic) with this template; set it to 0")
    return tok(head, add_special_tokens=False)["input_ids"]
