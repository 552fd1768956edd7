"""What an aux-layer id means to each engine, per version and model family or engine class: :data:`RULES`.

Each rule was read from the engine source it names, and is used by :mod:`eaglepipe.contract.convention` (which
translates ids and boundaries with it; its docstring names the id spaces). A rule applies to a target through
its family (``families``, hand-listed: the versions whose source was read, including ones not installed here) or
through the engine class that captures for the target's architecture (``classes``, "file:Class" as the installed
engine's capture table names them: eaglepipe/contract/capture_table.json, :mod:`eaglepipe.contract.capture_support`),
so a family an engine serves through an inherited class (phi3 → Llama's) needs no rule of its own.
tests/test_capture_support.py checks both agree with the installed engines' code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from eaglepipe.errors import ConventionError

ANY = "*"  # a rule for every family (hf: eaglepipe's own hooks, see eaglepipe/target/capture_check.py)


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
    """How one engine (in some version ranges) maps draft-config ids of some families / classes to boundaries."""

    engine: str
    versions: tuple[str, ...]  # PEP 440 specifiers, any of which matches; ("",) = any version
    families: tuple[str, ...]
    meaning: str  # one line for humans: what id i means
    read: Callable[[list[int], int], list[int]] | None  # ids, N -> boundaries; None = refused
    capturable: Callable[[int], range] | None  # N -> boundaries its capture loop can append
    source: str  # file + function the rule was read from
    classes: tuple[str, ...] = ()  # engine classes "file:Class" whose capture code the rule was read from
    form: str | None = None  # SGLang: the id form (capture_code.FORMS) of which this rule is the reading


_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
_DEEPSEEK = ("deepseek_v2", "deepseek_v3", "kimi_k25")
_SGLANG_0517 = ">=0.5.17,<0.5.18"
_SGLANG_0523 = ">=0.5.23,<0.5.24"
_SGLANG = (_SGLANG_0517, _SGLANG_0523)
_VLLM_026 = ">=0.26.0,<0.27"
_VLLM_032 = ">=0.32.0,<0.33"
_VLLM_033 = ">=0.33.0,<0.34"  # read from its wheel, not run (no CPU build of it): capture_table.json's 0.33.0
_VLLM = (_VLLM_026, _VLLM_032)
SGLANG_DIR, VLLM_DIR = "sglang/srt/models/", "vllm/model_executor/models/"  # where each engine's model classes live

RULES: tuple[Rule, ...] = (
    Rule("hf", ("",), (ANY,), "id i = h[i] (identity; index N is pre-norm in eaglepipe's capture)",
         _identity, lambda n: range(0, n + 1), "eaglepipe's own HF capture (eaglepipe/engines/hf.py hooks on "
         "model.model.layers)"),
    Rule("sglang", _SGLANG, _LLAMA_LIKE, "id i = h[i+1]", _plus_one, lambda n: range(1, n),
         "sglang/srt/models/{llama,qwen2,qwen3,qwen3_moe}.py set_eagle3_layers_to_capture "
         "(layers_to_capture = [val + 1 ...], identical in 0.5.17 and 0.5.23); the model forward captures "
         "before layer i, i < N (0.5.17: LlamaModel.forward / Qwen2Model.forward inline, Qwen2MoeModel via "
         "LayerCommunicator.prepare_attn_and_capture_last_layer_outputs; 0.5.23: layer_boundary/stage.py)",
         (f"{SGLANG_DIR}llama.py:LlamaForCausalLM", f"{SGLANG_DIR}qwen2.py:Qwen2ForCausalLM",
          f"{SGLANG_DIR}qwen3.py:Qwen3ForCausalLM", f"{SGLANG_DIR}qwen3_moe.py:Qwen3MoeForCausalLM"),
         form="plus_one"),
    Rule("sglang", _SGLANG, _DEEPSEEK, "ids[0] == 1: id i = h[i+1]; otherwise id i = h[i]",
         _plus_one_if_first_is_one, lambda n: range(0, n),
         "sglang/srt/models/deepseek_v2.py set_eagle3_layers_to_capture "
         "(`if layer_ids and layer_ids[0] == 1`, identical in 0.5.17 and 0.5.23), sglang PR #25454; "
         "DeepseekV2Model.forward captures before layer i, i < N (the residual after prepare_attn: the "
         "embeddings before layer 0); kimi_k25.py delegates to DeepseekV3ForCausalLM",
         (f"{SGLANG_DIR}deepseek_v2.py:DeepseekV2ForCausalLM",
          f"{SGLANG_DIR}kimi_k25.py:KimiK25ForConditionalGeneration"), form="plus_one_if_first_is_one"),
    Rule("sglang", (_SGLANG_0523,), ("glm4_moe_lite",), "ids[0] == 1: id i = h[i+1]; otherwise id i = h[i]",
         _plus_one_if_first_is_one, lambda n: range(0, n),
         "sglang/srt/models/glm4_moe_lite.py set_eagle3_layers_to_capture "
         "(`if layer_ids and layer_ids[0] == 1`), sglang PR #25454; Glm4MoeLiteModel.forward captures "
         "before layer i, i < N", (f"{SGLANG_DIR}glm4_moe_lite.py:Glm4MoeLiteForCausalLM",)),
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
         "before the loop and boundary i + 1 after layer i, up to h[N] before the final norm",
         (f"{SGLANG_DIR}gpt_oss.py:GptOssForCausalLM",), form="identity_if_max_is_n"),
    Rule("sglang", _SGLANG, ("gemma3",),
         "refused: SGLang's Gemma3TextModel captures `hidden_states` without `residual` (the previous "
         "layer's MLP branch output), which is no residual-stream boundary h[k]",
         None, None, "sglang/srt/models/gemma3_causal.py Gemma3TextModel.forward (identical in 0.5.17 "
         "and 0.5.23); gemma3_mm.py delegates to it",
         (f"{SGLANG_DIR}gemma3_causal.py:Gemma3ForCausalLM",
          f"{SGLANG_DIR}gemma3_mm.py:Gemma3ForConditionalGeneration")),
    Rule("vllm", _VLLM, _LLAMA_LIKE + ("gpt_oss",), "id i = h[i]", _identity, lambda n: range(0, n + 1),
         "vllm/model_executor/models/interfaces.py EagleModelMixin._maybe_add_hidden_state, called before "
         "layer 0 and with idx + 1 after each layer in llama.py, qwen2.py, qwen3_moe.py, gpt_oss.py (0.26's "
         "llama.py / qwen2.py count idx per pipeline stage: the same ids with one stage); mistral.py's "
         "MistralModel.forward and qwen3.py's Qwen3Model are llama.py's / qwen2.py's forward",
         (f"{VLLM_DIR}llama.py:LlamaForCausalLM", f"{VLLM_DIR}mistral.py:MistralForCausalLM",
          f"{VLLM_DIR}qwen2.py:Qwen2ForCausalLM", f"{VLLM_DIR}qwen3.py:Qwen3ForCausalLM",
          f"{VLLM_DIR}qwen3_moe.py:Qwen3MoeForCausalLM", f"{VLLM_DIR}gpt_oss.py:GptOssForCausalLM")),
    Rule("vllm", _VLLM, _DEEPSEEK, "id i = h[i]", _identity,
         lambda n: range(1, n + 1),
         "vllm/model_executor/models/deepseek_v2.py DeepseekV2Model.forward (hidden_states + residual "
         "before layer idx, residual None before layer 0; end_layer after the loop; same in 0.26 and "
         "0.32); kimi_k25.py wraps DeepseekV2ForCausalLM",
         (f"{VLLM_DIR}deepseek_v2.py:DeepseekV2ForCausalLM",
          f"{VLLM_DIR}kimi_k25.py:KimiK25ForConditionalGeneration")),
    Rule("vllm", _VLLM, ("glm4_moe_lite", "gemma3"),
         "refused: vLLM's Glm4MoeLiteForCausalLM / Gemma3ForCausalLM do not implement SupportsEagle3",
         None, None, "vllm/model_executor/models/glm4_moe_lite.py, gemma3.py class bases (0.26 and 0.32)"),
    # classes only: families whose vLLM 0.32 class is one of these get the rule through the capture table
    Rule("vllm", (_VLLM_032,), (), "id i = h[i]", _identity, lambda n: range(0, n + 1),
         "vllm/model_executor/models/granite.py GraniteModel.forward: _maybe_add_hidden_state(.., 0, "
         "embeddings × embedding_multiplier, None) before layer 0 and idx + 1 after each layer, whose output "
         "already holds the residual (GraniteDecoderLayer adds it, scaled by residual_multiplier)",
         (f"{VLLM_DIR}granite.py:GraniteForCausalLM",)),
    Rule("vllm", (_VLLM_032, _VLLM_033), (),
         "id i = h[i] for 1 ≤ i ≤ N; id 0 is not h[0]: the hook takes layer `0 - 1` (KeyError -1 at start)",
         _identity, lambda n: range(1, n + 1),
         "vllm/model_executor/models/transformers/base.py Base.set_aux_hidden_state_layers: a transformers "
         "OutputRecorder on the output of decoder layer `layer - 1` (\"layer - 1 because we want the input to "
         "the layer\"); `_layer_names` is a dict, so id 0 looks up layer -1 and the engine fails to start "
         "(measured, tests/test_capture_support.py); TransformersForCausalLM = CausalMixin + Base; 0.33.0 (read, "
         "not run): only Base.__init__ changed (the model built through _create_model), set_aux_hidden_state_layers "
         "and forward are 0.32's",
         (f"{VLLM_DIR}transformers/causal.py:CausalMixin",)),
)


def version_matches(rule: Rule, version: Version | None) -> bool:
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
