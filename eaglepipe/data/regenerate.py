"""extract's step 1: every assistant turn replaced by the target's own completion (and a synthetic record's user
turns written by the target first), by ``extract.regenerate_engine``; with ``extract.thinking``, in the
conversation's thinking mode, its last turn kept as the ids the target generated."""

from __future__ import annotations

from eaglepipe.data.prompts import is_synthetic
from eaglepipe.data.template import generation_prompt, user_prompt
from eaglepipe.params import ExtractParams
from eaglepipe.target.reasoning import HARMONY, harmony_message, template_kwargs, thinking_on


def regenerate(engine, tok, convs: list[dict], p: ExtractParams, switch: str | None = None) -> list[dict]:
    """Replace each assistant turn by the target's completion (greedy if p.temperature == 0).

    With ``p.thinking`` other than "template", each record gets ``thinking`` (on or off,
    :func:`eaglepipe.target.reasoning.thinking_on`), its prompts are rendered with the template's ``switch``, a
    turn with thinking on may write ``p.max_thinking_tokens`` tokens, and the last turn also keeps ``generated``: its
    prompt and completion ids exactly as generated (reasoning, no end-of-turn when cut), which
    :func:`eaglepipe.data.template.tokenize_generated` trains on. A harmony target (``switch`` reasoning_effort)
    gets ``p.reasoning_effort`` in every mode, and each turn it writes is taken back as its template takes one:
    the final channel as content, the analysis channel as ``thinking``
    (:func:`eaglepipe.target.reasoning.harmony_message`).

    A synthetic record's (:func:`eaglepipe.data.prompts.is_synthetic`) empty user turns are written first by the
    target itself: sampled at ``p.synthetic_temperature`` from :func:`eaglepipe.data.template.user_prompt`
    (Magpie, arXiv:2406.08464), under the record's ``steer`` system turn if it has one (:func:`_steered`), then
    answered like any other turn (without it). Returns new records (``messages``
    rewritten, ``regenerated: true``); a completion that decodes to empty text keeps the original turn and is marked ``regenerate_empty`` (a
    synthetic record whose user turn came out empty too: see :func:`drop_empty_synthetic`).
    """
    convs = [dict(c, messages=[dict(m) for m in c["messages"]]) for c in convs]
    if p.thinking != "template":
        for c in convs:
            c["thinking"] = thinking_on(c["id"], p.thinking, p.thinking_share, p.seed)
    n_turns = max(len(c["messages"]) for c in convs)
    for i in range(n_turns):
        users = [c for c in convs if is_synthetic(c["id"]) and i < len(c["messages"])
                 and c["messages"][i]["role"] == "user" and not c["messages"][i]["content"]]
        if users:
            outs = engine.generate([user_prompt(tok, _steered(c, i)) for c in users], p.max_new_tokens,
                                   p.synthetic_temperature, _synthetic_seed(users, p.seed))
            _fill(tok, users, i, outs, None)
        todo = [c for c in convs if i < len(c["messages"]) and c["messages"][i]["role"] == "assistant"]
        if not todo:
            continue
        for on in (None, False, True):  # one generate call per token budget
            group = [c for c in todo if c.get("thinking") is on]
            if not group:
                continue
            kwargs = template_kwargs(switch, on, p.reasoning_effort)
            prompts = [generation_prompt(tok, c["messages"][:i], kwargs) for c in group]
            outs = engine.generate(prompts, p.max_thinking_tokens if on else p.max_new_tokens, p.temperature,
                                   p.seed + i)
            _fill(tok, group, i, outs, switch)
            if on is not None:
                _keep_generated(group, i, prompts, outs)
        for c in todo:
            c["regenerated"] = True
    return convs


def _keep_generated(convs: list[dict], i: int, prompts: list[list[int]], outs: list[list[int]]) -> None:
    """A thinking-mode record whose turn ``i`` is its last keeps ``generated``: that turn's prompt and completion
    ids exactly as the target read and wrote them (:func:`regenerate`)."""
    for c, prompt, ids in zip(convs, prompts, outs):
        if i == len(c["messages"]) - 1 and not c.get("regenerate_empty"):
            c["generated"] = {"prompt": list(prompt), "completion": list(ids)}


def _steered(conv: dict, i: int) -> list[dict]:
    """The messages a synthetic record's user turn i is written after: its first i messages, led by its
    ``steer`` system turn (:func:`eaglepipe.data.prompts.synthetic_records`) when it has one."""
    steer = conv.get("steer")
    return ([{"role": "system", "content": steer}] if steer else []) + conv["messages"][:i]


def _fill(tok, convs: list[dict], i: int, outs: list[list[int]], switch: str | None) -> None:
    for c, ids in zip(convs, outs):
        msg = (harmony_message(tok, ids) if switch == HARMONY else
               {"content": tok.decode(ids, skip_special_tokens=True).strip()})
        if msg["content"] or msg.get("thinking"):
            c["messages"][i] = {**{k: v for k, v in c["messages"][i].items() if k != "thinking"}, **msg}
        else:
            c["regenerate_empty"] = True


def _synthetic_seed(users: list[dict], seed: int) -> int:
    """The sampling seed of one generate call over synthetic records: vLLM and SGLang seed prompt j with
    seed + j, so starting at the first record's number gives every record (consecutive ids, see
    :func:`eaglepipe.data.prompts.synthetic_records`) its own seed, whatever shard it falls in."""
    return seed + int(users[0]["id"].rsplit("-", 1)[-1])


def drop_empty_synthetic(convs: list[dict]) -> tuple[list[dict], int]:
    """(the records without an empty synthetic user turn, how many were dropped): a user turn the target
    left empty is no conversation to train on, so it is a counted skip, never an empty prompt."""
    kept = [c for c in convs if not (is_synthetic(c["id"]) and any(
        m["role"] == "user" and not m["content"] for m in c["messages"]))]
    return kept, len(convs) - len(kept)
