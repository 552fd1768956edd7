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
``render(msgs[:i+1])`` ends just after it (trailing whitespace dropped). A conversation regenerated with a
thinking switch (:mod:`eaglepipe.target.reasoning`) is rendered with it, and its last turn is the target's own
completion as generated (:func:`tokenize_generated`): the generation prompt's ids, then the very ids the target
wrote (an unfinished reasoning trace or a missing end-of-turn included), never the template's re-rendering of
them, which may drop, add or reshape the reasoning, nor a decode and re-encode, which need not give the same tokens.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from eaglepipe.errors import CaptureMismatch
from eaglepipe.target.reasoning import reasoning_regions, template_markers


@dataclass
class Tokenized:
    """input_ids int64 (T,); loss_mask bool (T,); assistant bool (T,) (token t is assistant text); reasoning bool
    (T,) (token t is assistant text inside a reasoning region of the template's form,
    :func:`eaglepipe.target.reasoning.reasoning_regions`)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    assistant: torch.Tensor
    reasoning: torch.Tensor
    open_at_end: bool = False  # a reasoning region is still open at the last token (a trace cut by the budget)


# The day every template is rendered on. Templates may print today's date (gpt-oss's harmony system message:
# "Current date: " + strftime_now("%Y-%m-%d"), the helper transformers gives templates); pinned, a sample's tokens do
# not depend on the day it is extracted, so DVC's outputs stay byte-reproducible.
RENDER_DAY = datetime.date(2026, 1, 1)


def _strftime(fmt: str) -> str:
    return RENDER_DAY.strftime(fmt)


def _render(tok, messages: list[dict], gen_prompt: bool, kwargs: dict | None = None) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt,
                                   **{"strftime_now": _strftime, **(kwargs or {})})


def assistant_spans(tok, messages: list[dict], kwargs: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character spans of its assistant turns; ``kwargs``: the chat
    template's options (a thinking switch).

    Raises CaptureMismatch when the template is not prefix-stable (rendering a prefix does not give a
    prefix of the full text), since then no span can be trusted.
    """
    full = _render(tok, messages, False, kwargs)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render(tok, messages[:i], True, kwargs)
        upto = _render(tok, messages[: i + 1], False, kwargs).rstrip()
        if not (full.startswith(head) and full.startswith(upto) and len(upto) > len(head)):
            raise CaptureMismatch(
                f"chat template is not prefix-stable at message {i}: cannot locate the assistant turn"
            )
        spans.append((len(head), len(upto)))
    return full, spans


def tokenize_conversation(tok, messages: list[dict], max_length: int, kwargs: dict | None = None,
                          train_reasoning: bool = True) -> Tokenized:
    """Render ``messages`` with the tokenizer's chat template and build the shifted loss mask.

    Args:
        tok: a fast HF tokenizer with a chat template (offset mapping is needed).
        messages: [{"role": "system"|"user"|"assistant", "content": str}, ...].
        max_length: sequences are cut to this many tokens.
        kwargs: the chat template's options (a thinking switch).
        train_reasoning: False leaves reasoning tokens out of the loss mask (params ``extract.train_reasoning``).
    Returns:
        :class:`Tokenized` with tensors of length T ≤ max_length.
    """
    text, spans = assistant_spans(tok, messages, kwargs)
    regions = reasoning_regions(text, template_markers(tok.chat_template))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assistant = [any(s <= a < e for s, e in spans) for a, _ in enc["offset_mapping"]]
    inside = [next((r for r in regions if r.start <= a < r.end), None) for a, _ in enc["offset_mapping"]]
    reasoning = [a and r is not None for a, r in zip(assistant, inside)]
    still_open = [r is not None and (not r.closed or b < r.end) for r, (_, b) in zip(inside, enc["offset_mapping"])]
    return _tokenized(enc["input_ids"], assistant, reasoning, still_open, max_length, train_reasoning)


def tokenize_generated(tok, prompt: list[int], completion: list[int], max_length: int,
                       train_reasoning: bool = True) -> Tokenized:
    """The sample of a turn as generated (module docstring): ``prompt`` (the generation prompt's ids) then
    ``completion`` (the ids the target wrote), the completion the assistant turn. A token is reasoning from the
    first token of the template form's open marker through the last of its close marker
    (:func:`eaglepipe.target.reasoning.template_markers`: ``<think>`` … ``</think>``, or harmony's analysis channel),
    the prompt's own markers included (a prompt that opens ``<think>`` makes the completion reasoning until it
    closes). Raises CaptureMismatch when the tokenizer does not encode either marker without unknown tokens."""
    m = template_markers(tok.chat_template)
    open_ids, close_ids = (tok(s, add_special_tokens=False)["input_ids"] for s in (m.open, m.close))
    if tok.unk_token_id in open_ids + close_ids or not open_ids or not close_ids:
        raise CaptureMismatch(f"the tokenizer cannot encode {m.open} and {m.close}: the reasoning in a completion "
                              "cannot be told from its answer")
    ids, opened_at, reasoning, still_open = [*prompt, *completion], None, [], []
    for i in range(len(ids)):
        if opened_at is None and ids[i : i + len(open_ids)] == open_ids:
            opened_at = i
        reasoning.append(opened_at is not None)
        if opened_at is not None and i + 1 - len(close_ids) >= opened_at + len(open_ids) \
                and ids[i + 1 - len(close_ids) : i + 1] == close_ids:
            opened_at = None
        still_open.append(opened_at is not None)
    assistant = [False] * len(prompt) + [True] * len(completion)
    reasoning = [a and r for a, r in zip(assistant, reasoning)]
    return _tokenized(ids, assistant, reasoning, still_open, max_length, train_reasoning)


def _tokenized(ids: list[int], assistant: list[bool], reasoning: list[bool], still_open: list[bool],
               max_length: int, train_reasoning: bool) -> Tokenized:
    """The :class:`Tokenized` of per-token lists (``still_open[t]``: a reasoning region is open after token t), cut
    to ``max_length``, with the shifted loss mask."""
    ids, assistant, reasoning = ids[:max_length], assistant[:max_length], reasoning[:max_length]
    open_at_end = bool(reasoning) and reasoning[-1] and still_open[len(ids) - 1]
    assistant, reasoning = torch.tensor(assistant, dtype=torch.bool), torch.tensor(reasoning, dtype=torch.bool)
    trained = assistant if train_reasoning else assistant & ~reasoning
    loss_mask = torch.zeros_like(assistant)
    loss_mask[:-1] = trained[1:]
    return Tokenized(torch.tensor(ids, dtype=torch.int64), loss_mask, assistant, reasoning, open_at_end)


def generation_prompt(tok, messages: list[dict], kwargs: dict | None = None) -> list[int]:
    """Token ids of ``messages`` followed by the template's assistant header (what the target completes);
    ``kwargs``: the chat template's options (a thinking switch)."""
    return tok(_render(tok, messages, True, kwargs), add_special_tokens=False)["input_ids"]


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
