"""A reasoning target's thinking switch, the mode each conversation is regenerated in, and where its reasoning lies.

Reasoning targets render their chat template with a switch: a Jinja variable the template reads, which the
engines pass as chat-template options (vLLM's and SGLang's ``chat_template_kwargs``, transformers'
``apply_chat_template(**kwargs)``). eaglepipe renders every prompt itself, so the switch goes to
``apply_chat_template``:

  ``enable_thinking``   Qwen3 hybrid templates (GLM-4.5 likewise): thinking by default; off writes an empty
                        ``<think>\\n\\n</think>\\n\\n`` into the generation prompt
  ``thinking``          DeepSeek-V3.1 and Kimi-K2.5 templates: the generation prompt ends in ``<think>`` (on) or
                        ``</think>`` (off)
  ``reasoning_effort``  gpt-oss's harmony format: always reasons, in its analysis channel; low / medium / high set
                        how long (written into the system message), and there is no off

The switch is found in the template's own source, as the undeclared variables Jinja's parser reports
(``jinja2.meta.find_undeclared_variables``), so a template that never reads it is refused rather than rendered
unchanged. The reasoning runs from the form's open marker through its close marker, both included, whether the
target or the template's generation prompt opened it: ``<think>`` … ``</think>``, or harmony's
``<|channel|>analysis<|message|>`` … ``<|end|>`` (the final channel's header and text after it are the answer); a
region still open where the text ends is a trace cut by the token budget.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from eaglepipe.errors import ParamsError

SWITCHES = {"enable_thinking": "Qwen3 / GLM-4.5 form", "thinking": "DeepSeek-V3.1 / Kimi-K2.5 form",
            "reasoning_effort": "gpt-oss harmony form"}
HARMONY = "reasoning_effort"  # the switch of the one form with no off: its value is an effort, not on / off


@dataclass(frozen=True)
class Markers:
    """Where a form's reasoning opens and closes in the text (both markers are part of the reasoning)."""

    open: str
    close: str


THINK = Markers("<think>", "</think>")
HARMONY_ANALYSIS = Markers("<|channel|>analysis<|message|>", "<|end|>")


def template_text(folder: str | Path) -> str:
    """The chat template a target folder ships: ``chat_template.jinja`` (what ``target.chat_template`` writes), else
    ``tokenizer_config.json``'s ``chat_template`` (a named list's ``default`` entry); "" when it has none."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    cfg = folder / "tokenizer_config.json"
    tpl = json.loads(cfg.read_text()).get("chat_template", "") if cfg.is_file() else ""
    if isinstance(tpl, list):  # [{"name": ..., "template": ...}, ...]
        tpl = next((t["template"] for t in tpl if t.get("name") == "default"), "")
    return tpl or ""


@functools.lru_cache(maxsize=8)
def thinking_switch(template: str) -> str | None:
    """The variable of :data:`SWITCHES` that ``template`` reads (the first, in that order), None when it reads none
    or does not parse."""
    import jinja2
    from jinja2 import meta

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return None
    names = meta.find_undeclared_variables(ast)
    return next((s for s in SWITCHES if s in names), None)


def no_switch_reason(template: str) -> str:
    """Why ``template`` offers no thinking switch, for a refusal's message."""
    if not template:
        return "the target has no chat template"
    looked = ", ".join(f"{k} ({v})" for k, v in SWITCHES.items())
    return (f"its chat template reads none of the thinking switches eaglepipe knows: {looked} (found with "
            "jinja2.meta.find_undeclared_variables on the template's source)")


def has_off(switch: str | None) -> bool:
    """Whether the form whose switch is ``switch`` can answer without reasoning (every form but harmony's)."""
    return switch != HARMONY


def template_markers(template: str | None) -> Markers:
    """The reasoning markers of a chat template's form (:func:`thinking_switch`): harmony's analysis channel, else
    :data:`THINK` (also for a template without a switch)."""
    return HARMONY_ANALYSIS if template and thinking_switch(template) == HARMONY else THINK


def thinking_on(conv_id: str, mode: str, share: float, seed: int) -> bool | None:
    """Whether conversation ``conv_id`` is rendered with thinking on: params ``extract.thinking`` ``mode`` "on" /
    "off", or for "mix" on with probability ``share``, drawn from a hash of (``seed``, ``conv_id``) so the draw does
    not depend on the shard or worker; None for "template" (the switch is not passed)."""
    if mode == "template":
        return None
    if mode != "mix":
        return mode == "on"
    draw = int.from_bytes(hashlib.sha256(f"{seed}:{conv_id}".encode()).digest()[:8], "big") / 2**64
    return draw < share


def template_kwargs(switch: str | None, on: bool | None, effort: str | None = None) -> dict:
    """``apply_chat_template`` keyword arguments for a conversation: ``{switch: on}``; for the harmony form
    ``{"reasoning_effort": effort}`` in any mode (params ``extract.reasoning_effort``; none: the template's
    default); else none."""
    if switch == HARMONY:
        return {HARMONY: effort} if effort else {}
    return {} if switch is None or on is None else {switch: on}


@dataclass(frozen=True)
class Region:
    """Characters ``[start, end)`` of a text that are reasoning; ``closed`` False: still open where the text ends."""

    start: int
    end: int
    closed: bool


def reasoning_regions(text: str, m: Markers = THINK) -> list[Region]:
    """The reasoning regions of ``text``, each from ``m.open`` through ``m.close`` (both markers included), or
    through the end of ``text`` when no close follows."""
    out, at = [], 0
    while (start := text.find(m.open, at)) >= 0:
        close = text.find(m.close, start + len(m.open))
        if close < 0:
            out.append(Region(start, len(text), False))
            break
        out.append(Region(start, close + len(m.close), True))
        at = close + len(m.close)
    return out


def harmony_message(tok, ids: list[int]) -> dict:
    """An assistant message of the harmony form from the ids the target wrote (``<|channel|>analysis<|message|>R
    <|end|><|start|>assistant<|channel|>final<|message|>A<|return|>``): ``{"content": A, "thinking": R}`` (each
    decoded), as gpt-oss's template takes a turn back (its analysis rendered only for a final turn). A channel is
    named by its header's ids (the tokenizer's encoding of "analysis" / "final"); other channels are dropped. Ids
    that open no channel are all content; a channel cut by the budget runs to the end."""
    channel, message = tok.convert_tokens_to_ids("<|channel|>"), tok.convert_tokens_to_ids("<|message|>")
    stops = set(tok.convert_tokens_to_ids(["<|end|>", "<|return|>", "<|call|>", "<|start|>"]))
    names = {tuple(tok(n, add_special_tokens=False)["input_ids"]): n for n in ("analysis", "final")}
    parts, n, at = {}, len(ids), 0
    while (head := next((j + 1 for j in range(at, n) if ids[j] == channel), None)) is not None:
        body = next((j + 1 for j in range(head, n) if ids[j] == message), n)
        at = next((j for j in range(body, n) if ids[j] in stops), n)  # the channel's text ends here
        if name := names.get(tuple(ids[head : body - 1])):
            parts[name] = tok.decode(ids[body:at], skip_special_tokens=True)
    if not parts and channel not in ids:
        return {"content": tok.decode(ids, skip_special_tokens=True).strip()}
    return {"content": parts.get("final", "").strip(), **({"thinking": parts["analysis"].strip()}
                                                           if "analysis" in parts else {})}


def require_switch(mode: str, template: str, source: str, effort: str | None = None,
                   max_turns: int = 1) -> str | None:
    """The thinking switch ``template`` reads where params ``extract.thinking`` ``mode`` (or an
    ``extract.reasoning_effort``) needs one (None for "template"). Raises ParamsError (exit 2, at the target stage)
    when it reads none, when a harmony template is asked for thinking off (it has none) or for several turns a sample
    (it ends the last assistant turn with ``<|return|>``, earlier ones with ``<|end|>``, so no turn's text is a prefix
    of the whole), or when an effort is set for another form."""
    switch = thinking_switch(template)
    if effort and switch != HARMONY:
        raise ParamsError(f"extract.reasoning_effort: {effort}, but the target {source}'s chat template does not read "
                          "reasoning_effort (gpt-oss's harmony form): set extract.reasoning_effort: null")
    if not has_off(switch) and (mode in ("off", "mix") or max_turns > 1):
        why = (f"extract.thinking: {mode}" if mode in ("off", "mix") else f"prompts.max_turns: {max_turns}")
        raise ParamsError(f"{why}, but the target {source} writes gpt-oss's harmony format: it always reasons (no off "
                          "switch; extract.reasoning_effort: low makes it reason least) and its template ends the "
                          "last assistant turn otherwise than earlier ones. Set extract.thinking: on or template and "
                          "prompts.max_turns: 1")
    if mode == "template":
        return None
    if switch is None:
        raise ParamsError(f"extract.thinking: {mode}, but the target {source}: {no_switch_reason(template)}. Set "
                          "extract.thinking: template, or give target.chat_template a template with the switch")
    return switch
