"""A reasoning target's thinking switch, the mode each conversation is regenerated in, and where its reasoning lies.

Hybrid reasoning targets render their chat template with a switch: a Jinja variable the template reads, which the
engines pass as chat-template options (vLLM's and SGLang's ``chat_template_kwargs``, transformers'
``apply_chat_template(**kwargs)``). eaglepipe renders every prompt itself, so the switch goes to
``apply_chat_template``:

  ``enable_thinking``  Qwen3 hybrid templates (GLM-4.5 likewise): thinking by default; off writes an empty
                       ``<think>\\n\\n</think>\\n\\n`` into the generation prompt
  ``thinking``         DeepSeek-V3.1 and Kimi-K2.5 templates: the generation prompt ends in ``<think>`` (on) or
                       ``</think>`` (off)

The switch is found in the template's own source, as the undeclared variables Jinja's parser reports
(``jinja2.meta.find_undeclared_variables``), so a template that never reads it is refused rather than rendered
unchanged. The reasoning is the text from ``<think>`` to ``</think>`` inclusive, whether the target or the
template's generation prompt opened it; a region still open where the text ends is a trace cut by the token budget.
gpt-oss's harmony format (analysis channel, ``reasoning_effort``) always reasons, has no off switch and is not
parsed here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from eaglepipe.errors import ParamsError

SWITCHES = {"enable_thinking": "Qwen3 / GLM-4.5 form", "thinking": "DeepSeek-V3.1 / Kimi-K2.5 form"}
OPEN, CLOSE = "<think>", "</think>"


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
    why = f"its chat template reads none of the thinking switches eaglepipe knows: {looked}"
    if "reasoning_effort" in template:
        why += ("; it reads reasoning_effort: gpt-oss's harmony format always writes its analysis channel and has "
                "no off switch")
    return why + " (found with jinja2.meta.find_undeclared_variables on the template's source)"


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


def template_kwargs(switch: str | None, on: bool | None) -> dict:
    """``apply_chat_template`` keyword arguments for a conversation: ``{switch: on}``, or none."""
    return {} if switch is None or on is None else {switch: on}


@dataclass(frozen=True)
class Region:
    """Characters ``[start, end)`` of a text that are reasoning; ``closed`` False: still open where the text ends."""

    start: int
    end: int
    closed: bool


def reasoning_regions(text: str) -> list[Region]:
    """The reasoning regions of ``text``, each from :data:`OPEN` through :data:`CLOSE` (both markers included), or
    through the end of ``text`` when no close follows."""
    out, at = [], 0
    while (start := text.find(OPEN, at)) >= 0:
        close = text.find(CLOSE, start + len(OPEN))
        if close < 0:
            out.append(Region(start, len(text), False))
            break
        out.append(Region(start, close + len(CLOSE), True))
        at = close + len(CLOSE)
    return out


def require_switch(mode: str, template: str, source: str) -> str | None:
    """The thinking switch ``template`` reads where params ``extract.thinking`` ``mode`` needs one (None for
    "template"). Raises ParamsError (exit 2, at the target stage) when it reads none."""
    if mode == "template":
        return None
    if (switch := thinking_switch(template)) is None:
        raise ParamsError(f"extract.thinking: {mode}, but the target {source}: {no_switch_reason(template)}. Set "
                          "extract.thinking: template, or give target.chat_template a template with the switch")
    return switch
