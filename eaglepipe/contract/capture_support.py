"""Can an engine capture EAGLE-3 aux states for a model_type, and through which of its classes? The engines say.

Reads ``capture_table.json`` (next to this module), generated from the installed engines' own source by
:mod:`eaglepipe.contract.capture_scan` and checked against them by tests/test_capture_support.py:

- vLLM: the class its registry (``vllm/model_executor/models/registry.py``) maps the architecture to, and
  whether ``SupportsEagle3`` (``vllm/model_executor/models/interfaces.py``) is in its MRO;
- SGLang: the ``EntryClass`` of ``sglang/srt/models/*.py`` named like the architecture (``registry.py``), and
  whether a class of its MRO defines ``set_eagle3_layers_to_capture``;
- transformers (hf): model_type → the causal-LM architecture a checkpoint of it declares
  (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``).

What an id means through a capturing class is not decided here: :func:`eaglepipe.contract.convention.rule_for`
finds the rule of :data:`eaglepipe.contract.rules.RULES` that names the class's code. Imports no engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from packaging.version import InvalidVersion, Version

from eaglepipe.errors import ConventionError

TABLE_FILE = "capture_table.json"  # next to this module; a dvc dep of every stage importing it
REGENERATE = "python -m eaglepipe.contract.capture_scan"


@dataclass(frozen=True)
class Capture:
    """One engine version's answer for one architecture (classes as "file:Class", relative to site-packages)."""

    engine: str
    version: str  # the engine version the table was read from
    architecture: str  # e.g. "Phi3ForCausalLM"
    engine_class: str  # the class the engine's registry maps the architecture to
    capture_class: str | None  # the class that gives it EAGLE-3 capture; None: it has none
    code_class: str | None  # the class whose code decides what is captured (RULES' ``classes`` name these)
    why_not: str  # the engine's reason template, "{file}", "{cls}" filled by :attr:`refusal`
    form: str | None = None  # SGLang: the id form of its capture code (capture_code.FORMS), None: no known form
    at: str = ""  # "file:line" that shows the form (the class's def where there is none)
    language_model: str | None = None  # vLLM wrapper: the architecture its decoder is built as (capture_code)

    @property
    def refusal(self) -> str | None:
        """Why this engine version cannot capture the architecture, naming the engine file; None when it can."""
        if self.capture_class is not None:
            return None
        file, _, cls = self.engine_class.partition(":")
        why = self.why_not.format(file=file, cls=cls)
        return f"{self.engine} {self.version} has no EAGLE-3 capture for {self.architecture} ({why})"


@lru_cache(maxsize=1)
def table() -> dict:
    """The capture table (see the module docstring): engine → {version: section}."""
    return json.loads(Path(__file__).with_name(TABLE_FILE).read_text())


def reading_command(engine: str, version: str) -> str:
    """The commands that read an engine release into the table without installing it."""
    return (f"pip download --no-deps {engine}=={version} -d wheels && {REGENERATE} --wheel "
            f"wheels/{engine}-{version}-*.whl")


def section(engine: str, version: str) -> dict | None:
    """The table's section for ``engine`` at ``version`` (same X.Y.Z release), or None when it was not read."""
    return next((body for v, body in table().get(engine, {}).items() if _same_release(v, version)), None)


def read_versions(engine: str) -> list[str]:
    """The releases of ``engine`` the table was read from, oldest first."""
    return list(table().get(engine, {}))


def code_digest(engine: str, version: str, code_class: str) -> str | None:
    """The digest of ``code_class``'s capture code in that release (capture_code.digest), or None."""
    body = section(engine, version)
    return ((body or {}).get("capture_code", {}).get(code_class) or {}).get("digest")


def architecture_of(model_type: str) -> str | None:
    """The causal-LM architecture transformers gives ``model_type`` (``Phi3ForCausalLM`` for phi3), or None."""
    hf = list(table().get("hf", {}).values())
    return hf[-1]["model_types"].get(model_type) if hf else None


def _same_release(a: str, b: str) -> bool:
    """Same X.Y.Z release (local and post tags aside: ``0.32.0+cpu`` is ``0.32.0``)."""
    try:
        return Version(a).release == Version(b).release
    except InvalidVersion:
        return False


def lookup(engine: str, version: str, model_type: str) -> Capture:
    """What ``engine`` at ``version`` does with a target of ``model_type``, as read from the engine's code.

    Raises ConventionError: a release the table was not read from (naming :func:`reading_command`), a model_type
    transformers has no causal-LM architecture for, or an architecture the engine's registry does not name. A
    class that cannot capture is returned with its :attr:`Capture.refusal` set.
    """
    entry = _read_section(engine, version, f"family {model_type!r}")
    arch = architecture_of(model_type)
    if arch is None:
        hf = ", ".join(read_versions("hf"))
        raise ConventionError(
            f"unknown model family {model_type!r}: neither a family of eaglepipe/contract/rules.py nor a causal-LM "
            f"model_type of transformers {hf} (eaglepipe/contract/{TABLE_FILE})")
    return _capture(engine, entry, arch, f"model_type {model_type!r}")


def lookup_architecture(engine: str, version: str, architecture: str) -> Capture:
    """:func:`lookup` by the architecture name an engine's registry maps (a wrapper's language model,
    :attr:`Capture.language_model`). Raises ConventionError as :func:`lookup` does."""
    return _capture(engine, _read_section(engine, version, architecture), architecture, f"architecture {architecture}")


def _read_section(engine: str, version: str, what: str) -> dict:
    """:func:`section`, or ConventionError naming the releases read and the command that reads this one."""
    entry = section(engine, version)
    if entry is None:
        read = ", ".join(read_versions(engine)) or "(no release)"
        raise ConventionError(
            f"no layer-id rule for {engine} {version} with {what}: the capture table "
            f"(eaglepipe/contract/{TABLE_FILE}) was read from {engine} {read}; "
            f"refusing to guess. Read that release's source: {reading_command(engine, version)}")
    return entry


def _capture(engine: str, entry: dict, arch: str, what: str) -> Capture:
    row = entry["architectures"].get(arch)
    if row is None and entry["fallback"]:  # the engine runs it with its fallback class
        row = entry["architectures"][entry["fallback"]]
        arch = f"{arch} (not in {entry['registry']}: {entry['fallback']})"
    if row is None:
        raise ConventionError(
            f"{engine} {entry['version']} has no model class of its own for {arch} ({what}; "
            f"{entry['registry']} does not name it): it would try its Transformers backend, dense or MoE by the "
            f"config, which eaglepipe does not pick for it; refusing to guess")
    facts = entry["capture_code"].get(row[2]) or {}  # none for a class that cannot capture
    return Capture(engine, entry["version"], arch, row[0], row[1], row[2], entry["no_capture"],
                   facts.get("form"), facts.get("at", ""), facts.get("language_model"))
