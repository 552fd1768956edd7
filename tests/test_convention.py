"""The convention translator: one case per rule, both directions, and every refusal."""

import pytest

from eaglepipe.contract import convention as conv
from eaglepipe.contract import draft_config
from eaglepipe.errors import ConventionError

SGL, VLLM = "0.5.23", "0.32.0"

# (engine, version, family, N, boundaries h[k], ids the engine's config must hold)
FORWARD = [
    ("hf", None, "llama", 30, [0, 15, 30], [0, 15, 30]),
    ("sglang", SGL, "llama", 30, [2, 15, 27], [1, 14, 26]),  # id i = h[i+1]
    ("sglang", SGL, "mistral", 32, [2, 16, 29], [1, 15, 28]),
    ("sglang", SGL, "qwen3", 36, [1, 18, 35], [0, 17, 34]),
    ("sglang", SGL, "qwen3_moe", 48, [2, 24, 45], [1, 23, 44]),
    ("sglang", SGL, "deepseek_v3", 61, [2, 30, 58], [2, 30, 58]),  # first id 2 != 1: read as h[i]
    ("sglang", SGL, "kimi_k25", 61, [3, 31, 59], [3, 31, 59]),  # the doc's Kimi-K2.5 case
    ("sglang", SGL, "glm4_moe_lite", 47, [0, 23, 44], [0, 23, 44]),  # first id 0: embeddings reachable
    ("sglang", SGL, "gpt_oss", 36, [24, 30, 36], [24, 30, 36]),  # max id == N: read as h[i]
    ("sglang", SGL, "gpt_oss", 36, [2, 18, 33], [1, 17, 32]),  # no final boundary: h[i+1]
    ("vllm", VLLM, "llama", 30, [0, 15, 30], [0, 15, 30]),  # id i = h[i], h[0] and h[N] reachable
    ("vllm", VLLM, "qwen2", 28, [2, 14, 25], [2, 14, 25]),
    ("vllm", VLLM, "deepseek_v2", 27, [1, 13, 27], [1, 13, 27]),
    ("vllm", VLLM, "kimi_k25", 61, [3, 31, 59], [3, 31, 59]),
    ("vllm", VLLM, "gpt_oss", 24, [2, 12, 24], [2, 12, 24]),
    # families no rule lists, through the class each engine captures them with (capture_table.json)
    ("sglang", SGL, "phi3", 32, [2, 16, 29], [1, 15, 28]),  # Phi3ForCausalLM(LlamaForCausalLM): Llama's +1
    ("vllm", VLLM, "phi3", 32, [0, 16, 32], [0, 16, 32]),  # phi3.py subclasses llama.py's LlamaForCausalLM
    ("vllm", VLLM, "granite", 40, [0, 20, 40], [0, 20, 40]),  # granite.py implements SupportsEagle3
    ("vllm", VLLM, "olmo2", 16, [1, 8, 16], [1, 8, 16]),  # Transformers backend: h[1..N]
]


@pytest.mark.parametrize("engine,version,family,n,boundaries,ids", FORWARD)
def test_engine_ids_and_back(engine, version, family, n, boundaries, ids):
    assert conv.engine_ids(engine, family, boundaries, n, version) == ids
    assert conv.boundaries_of(engine, family, ids, n, version) == boundaries


# (engine, version, family, N, ids found in a config, boundaries the engine feeds)
READ = [
    ("sglang", SGL, "llama", 32, [1, 15, 28], [2, 16, 29]),  # the doc's consequence example ...
    ("vllm", VLLM, "llama", 32, [1, 15, 28], [1, 15, 28]),  # ... the same ids on vLLM
    ("sglang", SGL, "deepseek_v3", 61, [1, 29, 57], [2, 30, 58]),  # first id == 1: +1 on every id
    ("sglang", SGL, "kimi_k25", 61, [2, 30, 58], [2, 30, 58]),  # Kimi: "[2, 30, 58] is read as h[2], h[30], h[58]"
    ("sglang", SGL, "kimi_k25", 61, [30, 2, 58], [2, 30, 58]),  # unsorted: fed in layer order
    ("sglang", SGL, "gpt_oss", 36, [23, 29, 35], [24, 30, 36]),
    ("sglang", SGL, "gpt_oss", 36, [24, 30, 36], [24, 30, 36]),
    ("sglang", "0.5.23.post1", "qwen2", 28, [1, 13, 24], [2, 14, 25]),
    ("vllm", "0.32.0+cpu", "qwen3", 36, [2, 18, 33], [2, 18, 33]),
]


@pytest.mark.parametrize("engine,version,family,n,ids,fed", READ)
def test_boundaries_of(engine, version, family, n, ids, fed):
    assert conv.boundaries_of(engine, family, ids, n, version) == fed


@pytest.mark.parametrize(
    "engine,version,family,n,expected",
    [
        ("hf", None, "llama", 30, range(0, 31)),
        ("sglang", SGL, "llama", 30, range(1, 30)),  # no h[N]; h[0] would need id -1
        ("sglang", SGL, "deepseek_v2", 30, range(0, 30)),
        ("sglang", SGL, "gpt_oss", 36, range(0, 37)),
        ("vllm", VLLM, "llama", 30, range(0, 31)),
        ("vllm", VLLM, "deepseek_v3", 61, range(1, 62)),  # residual is None before layer 0
    ],
)
def test_capturable(engine, version, family, n, expected):
    assert conv.capturable(engine, family, n, version) == expected


@pytest.mark.parametrize("engine,version", [("sglang", SGL), ("vllm", VLLM)])
def test_default_boundaries(engine, version):
    assert conv.default_boundaries(engine, "llama", 30, version) == [2, 15, 27]
    assert conv.default_boundaries(engine, "deepseek_v3", 61, version) == [2, 30, 58]


# (callable, match): every refusal, with the words its message must carry
REFUSALS = [
    (lambda: conv.engine_ids("sglang", "llama", [2, 15, 30], 30, SGL), r"cannot capture h\[30\]"),
    (lambda: conv.engine_ids("sglang", "deepseek_v3", [1, 15, 27], 30, SGL),
     r"cannot be made to feed h\[1, 15, 27\].*\[1, 15, 27\] is read as h\[2, 16, 28\].*\[0, 14, 26\] is read as h\[0, 14, 26\]"),
    (lambda: conv.engine_ids("sglang", "gpt_oss", [0, 5, 10], 36, SGL), r"\[-1, 4, 9\]: negative id"),
    (lambda: conv.engine_ids("vllm", "deepseek_v2", [0, 13, 27], 27, VLLM), r"cannot capture h\[0\]"),
    (lambda: conv.engine_ids("sglang", "gemma3", [2, 13, 23], 26, SGL), r"without `residual`"),
    (lambda: conv.engine_ids("vllm", "glm4_moe_lite", [2, 23, 44], 47, VLLM), r"SupportsEagle3"),
    # a model_type no rule lists: the engine's own code decides, and its file is named
    (lambda: conv.engine_ids("vllm", "falcon", [2], 30, VLLM),
     r"vllm 0\.32\.0 has no EAGLE-3 capture for FalconForCausalLM \(vllm/model_executor/models/falcon\.py "
     r"FalconForCausalLM does not implement SupportsEagle3"),
    (lambda: conv.engine_ids("sglang", "granite", [2], 30, SGL),
     r"sglang 0\.5\.23 has no EAGLE-3 capture for GraniteForCausalLM \(sglang/srt/models/granite\.py defines no "
     r"set_eagle3_layers_to_capture"),
    (lambda: conv.engine_ids("sglang", "olmo2", [2], 30, SGL), r"sglang/srt/models/olmo2\.py defines no"),
    (lambda: conv.engine_ids("vllm", "phi3", [2], 30, "0.26.0"), r"capture table .* was read from vllm 0\.32\.0"),
    (lambda: conv.engine_ids("vllm", "not_a_model", [2], 30, VLLM), r"unknown model family 'not_a_model'"),
    # vLLM's Transformers backend (olmo2): id 0 would be layer `0 - 1`, never h[0]
    (lambda: conv.engine_ids("vllm", "olmo2", [0, 3, 6], 6, VLLM),
     r"cannot capture h\[0\] .*/transformers/base\.py Base\.set_aux_hidden_state_layers.*layer - 1"),
    (lambda: conv.boundaries_of("vllm", "olmo2", [0, 3], 6, VLLM), r"KeyError -1 at start\)\) ask for h\[0\]"),
    (lambda: conv.engine_ids("tgi", "llama", [2], 30, "1.0"), r"unknown engine 'tgi'"),
    (lambda: conv.engine_ids("vllm", "llama", [2], 30, "0.31.0"), r"no layer-id rule for vllm 0.31.0"),
    (lambda: conv.engine_ids("sglang", "llama", [2], 30, "0.5.22"), r"refusing to guess"),
    (lambda: conv.engine_ids("vllm", "llama", [2], 30, "latest"), r"not a PEP 440 version"),
    (lambda: conv.engine_ids("vllm", "llama", [15, 2], 30, VLLM), r"not ascending"),
    (lambda: conv.engine_ids("vllm", "llama", [2, 2], 30, VLLM), r"duplicates"),
    (lambda: conv.engine_ids("vllm", "llama", [2, 31], 30, VLLM), r"outside \[0, 30\]"),
    (lambda: conv.engine_ids("vllm", "llama", [], 30, VLLM), r"empty boundary list"),
    (lambda: conv.default_boundaries("vllm", "llama", 5, VLLM), r"\[2, 2, 2\] for N = 5 collapse to \[2\]"),
    (lambda: conv.default_boundaries("hf", "llama", 30), r"no default"),
    # SpecForge's default ids [1, N//2-1, N-4] on a 5-layer target
    (lambda: conv.boundaries_of("sglang", "llama", [1, 1, 1], 5, SGL), r"collapse to boundaries \[2, 2, 2\]"),
    (lambda: conv.boundaries_of("vllm", "qwen3", [3, 3, 7], 8, VLLM), r"feed 2 states where 3 are expected"),
    (lambda: conv.boundaries_of("sglang", "llama", [2, 15, 29], 30, SGL), r"ask for h\[30\]"),
    (lambda: conv.boundaries_of("sglang", "llama", [-1, 14], 30, SGL), r"negative id"),
    (lambda: conv.boundaries_of("vllm", "llama", [], 30, VLLM), r"empty id list"),
    (lambda: conv.check_fc_width(4 * 576, 3, 576), r"2304 input features but 3 aux states .* 1728; .* imply 4"),
    (lambda: conv.family_of({"hidden_size": 8}), r"no model_type"),
]


@pytest.mark.parametrize("call,match", REFUSALS)
def test_refusals(call, match):
    with pytest.raises(ConventionError, match=match):
        call()


def test_version_defaults_to_installed(monkeypatch):
    monkeypatch.setattr(conv, "installed_version", lambda engine: None)
    with pytest.raises(ConventionError, match="vllm is not installed here and no version was given"):
        conv.engine_ids("vllm", "llama", [2, 15, 27], 30)
    monkeypatch.setattr(conv, "installed_version", lambda engine: "0.32.0+cpu")
    assert conv.engine_ids("vllm", "llama", [2, 15, 27], 30) == [2, 15, 27]
    assert conv.KNOWN_VERSIONS == {"sglang": "0.5.23", "vllm": "0.33.0"}


@pytest.mark.parametrize(
    "config,family",
    [
        ({"model_type": "llama"}, "llama"),
        ({"model_type": "gemma3_text"}, "gemma3"),
        ({"model_type": "kimi_k2"}, "deepseek_v3"),
        ({"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}}, "kimi_k25"),
        ({"model_type": "some_vl_wrapper", "text_config": {"model_type": "qwen3"}}, "qwen3"),
        ({"model_type": "phi3"}, "phi3"),  # no rule lists it: its own family, decided by each engine's code
    ],
)
def test_family_of(config, family):
    assert conv.family_of(config) == family


def test_check_fc_width_accepts_match():
    assert conv.check_fc_width(3 * 576, 3, 576) is None


def test_missing_ids_refused_unless_default_allowed():
    draft = {"architectures": ["LlamaForCausalLMEagle3"]}
    with pytest.raises(ConventionError, match=r"τ 2.77 to 1.036"):
        draft_config.read_draft_boundaries(draft, "sglang", "llama", 30, SGL)
    assert draft_config.read_draft_boundaries(draft, "sglang", "llama", 30, SGL, allow_default=True) == [2, 15, 27]


def test_vllm_reads_top_level_before_nested():
    both = {"eagle_aux_hidden_state_layer_ids": [2, 15, 27], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}
    assert draft_config.read_draft_boundaries(both, "vllm", "llama", 30, VLLM) == [2, 15, 27]
    assert draft_config.read_draft_boundaries(both, "sglang", "llama", 30, SGL) == [2, 15, 27]
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}
    with pytest.raises(ConventionError, match="V2 runner .* ignores it"):
        draft_config.read_draft_boundaries(nested, "vllm", "llama", 30, VLLM)
    assert draft_config.read_draft_boundaries(nested, "vllm", "llama", 30, VLLM, runner="v1") == [1, 14, 26]
    assert draft_config.read_draft_boundaries(nested, "vllm", "llama", 30, VLLM, runner="v2", allow_default=True) == [2, 15, 27]


def test_write_draft_ids_for_both_engines():
    base = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {"use_aux_hidden_state": True}}
    sgl = draft_config.write_draft_ids(base, "sglang", "llama", [2, 15, 27], 30, SGL)
    both = draft_config.write_draft_ids(sgl, "vllm", "llama", [2, 15, 27], 30, VLLM)
    assert base == {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {"use_aux_hidden_state": True}}
    assert both == {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 14, 26]},
        "eagle_aux_hidden_state_layer_ids": [2, 15, 27],
        "num_aux_hidden_states": 3,
        "eaglepipe": {
            "aux_boundaries": [2, 15, 27],
            "convention": conv.CONVENTION,
            "family": "llama",
            "n_layers": 30,
            "engines": {
                "sglang": {"version": SGL, "ids": [1, 14, 26], "field": "eagle_config.eagle_aux_hidden_state_layer_ids"},
                "vllm": {"version": VLLM, "ids": [2, 15, 27], "field": "eagle_aux_hidden_state_layer_ids"},
            },
        },
    }
    for engine, version in (("sglang", SGL), ("vllm", VLLM), ("hf", None)):
        assert draft_config.read_draft_boundaries(both, engine, "llama", 30, version) == [2, 15, 27]
    with pytest.raises(ConventionError, match=r"already states aux_boundaries \[2, 15, 27\], not \[3, 15, 27\]"):
        draft_config.write_draft_ids(both, "vllm", "llama", [3, 15, 27], 30, VLLM)


def test_write_draft_ids_kimi_heuristic():
    out = draft_config.write_draft_ids({}, "sglang", "kimi_k25", [3, 31, 59], 61, SGL)
    assert out["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [3, 31, 59]}
    assert draft_config.read_draft_boundaries(out, "sglang", "kimi_k25", 61, SGL) == [3, 31, 59]


# --- the H200 machine's engines: sglang 0.5.17 and vllm 0.26.x, read from their wheels --------------------

SGL17, VLLM26 = "0.5.17", "0.26.0"


@pytest.mark.parametrize(
    "engine,version,family,n,boundaries,ids",
    [
        ("sglang", SGL17, "llama", 30, [2, 15, 27], [1, 14, 26]),  # id i = h[i+1], as in 0.5.23
        ("sglang", SGL17, "mistral", 32, [2, 16, 29], [1, 15, 28]),
        ("sglang", SGL17, "qwen2", 28, [1, 14, 27], [0, 13, 26]),
        ("sglang", SGL17, "qwen3", 36, [1, 18, 35], [0, 17, 34]),
        ("sglang", SGL17, "qwen3_moe", 48, [2, 24, 45], [1, 23, 44]),
        ("sglang", SGL17, "deepseek_v2", 27, [0, 13, 26], [0, 13, 26]),  # h[0]: residual after prepare_attn
        ("sglang", SGL17, "deepseek_v3", 61, [2, 30, 58], [2, 30, 58]),
        ("sglang", SGL17, "kimi_k25", 61, [3, 31, 59], [3, 31, 59]),
        ("sglang", SGL17, "glm4_moe_lite", 47, [2, 23, 44], [2, 23, 44]),
        ("sglang", SGL17, "gpt_oss", 36, [24, 30, 36], [24, 30, 36]),
        ("sglang", SGL17, "gpt_oss", 36, [2, 18, 33], [1, 17, 32]),
        ("vllm", VLLM26, "llama", 30, [0, 15, 30], [0, 15, 30]),  # id i = h[i], h[0] and h[N] reachable
        ("vllm", VLLM26, "mistral", 32, [2, 16, 29], [2, 16, 29]),
        ("vllm", VLLM26, "qwen2", 28, [2, 14, 25], [2, 14, 25]),
        ("vllm", VLLM26, "qwen3", 36, [0, 18, 36], [0, 18, 36]),
        ("vllm", VLLM26, "qwen3_moe", 48, [2, 24, 48], [2, 24, 48]),
        ("vllm", VLLM26, "gpt_oss", 24, [2, 12, 24], [2, 12, 24]),
        ("vllm", VLLM26, "deepseek_v2", 27, [1, 13, 27], [1, 13, 27]),
        ("vllm", VLLM26, "kimi_k25", 61, [3, 31, 59], [3, 31, 59]),
        ("vllm", "0.26.1", "deepseek_v3", 61, [2, 30, 61], [2, 30, 61]),  # the 0.26.x line
    ],
)
def test_h200_engine_versions_ids_and_back(engine, version, family, n, boundaries, ids):
    assert conv.engine_ids(engine, family, boundaries, n, version) == ids
    assert conv.boundaries_of(engine, family, ids, n, version) == boundaries


def test_h200_versions_resolve_to_rules():
    assert conv.VERIFIED_VERSIONS == {"sglang": ("0.5.17", "0.5.23"), "vllm": ("0.26.0", "0.32.0", "0.33.0")}
    assert conv.KNOWN_VERSIONS == {"sglang": "0.5.23", "vllm": "0.33.0"}  # export targets the newest read
    assert conv.resolve_version("vllm", "0.26.0") == "0.26.0"
    for engine, version in (("vllm", "0.26.0"), ("vllm", "0.26.0+cu130"), ("sglang", "0.5.17"),
                            ("sglang", "0.5.17.post1")):
        rule = conv.rule_for(engine, "llama", version)
        assert rule.engine == engine and rule.read is not None
    # identical source: one rule covers both versions (widened, not copied)
    assert conv.rule_for("vllm", "llama", "0.26.0") is conv.rule_for("vllm", "llama", "0.32.0")
    assert conv.rule_for("sglang", "deepseek_v3", "0.5.17") is conv.rule_for("sglang", "deepseek_v3", "0.5.23")
    # glm4_moe_lite differs between 0.5.17 and 0.5.23: two rules
    assert conv.rule_for("sglang", "glm4_moe_lite", "0.5.17") is not conv.rule_for("sglang", "glm4_moe_lite", "0.5.23")


@pytest.mark.parametrize("engine,version", [("sglang", SGL17), ("vllm", VLLM26)])
def test_h200_default_boundaries(engine, version):
    assert conv.default_boundaries(engine, "llama", 30, version) == [2, 15, 27]
    assert conv.default_boundaries(engine, "deepseek_v3", 61, version) == [2, 30, 58]


@pytest.mark.parametrize(
    "engine,version,family,n,expected",
    [
        ("sglang", SGL17, "llama", 30, range(1, 30)),
        ("sglang", SGL17, "qwen3_moe", 48, range(1, 48)),
        ("sglang", SGL17, "deepseek_v2", 30, range(0, 30)),
        ("sglang", SGL17, "glm4_moe_lite", 47, range(1, 47)),  # 0.5.23: range(0, 47)
        ("sglang", SGL, "glm4_moe_lite", 47, range(0, 47)),
        ("sglang", SGL17, "gpt_oss", 36, range(0, 37)),
        ("vllm", VLLM26, "llama", 30, range(0, 31)),
        ("vllm", VLLM26, "gpt_oss", 24, range(0, 25)),
        ("vllm", VLLM26, "deepseek_v3", 61, range(1, 62)),
    ],
)
def test_h200_capturable(engine, version, family, n, expected):
    assert conv.capturable(engine, family, n, version) == expected


def test_glm4_moe_lite_embeddings_accepted_in_sglang_0523_refused_in_0517():
    # 0.5.23 captures the residual stream (embeddings before layer 0); 0.5.17's Glm4MoeLiteModel.forward
    # computes `hidden_states + residual` with residual None there.
    assert conv.engine_ids("sglang", "glm4_moe_lite", [0, 23, 44], 47, SGL) == [0, 23, 44]
    with pytest.raises(ConventionError, match=r"sglang 0.5.17 cannot capture h\[0\] for family glm4_moe_lite"):
        conv.engine_ids("sglang", "glm4_moe_lite", [0, 23, 44], 47, SGL17)
    with pytest.raises(ConventionError, match=r"ask for h\[0\]"):
        conv.boundaries_of("sglang", "glm4_moe_lite", [0, 23, 44], 47, SGL17)
    assert conv.boundaries_of("sglang", "glm4_moe_lite", [1, 22, 43], 47, SGL17) == [2, 23, 44]


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: conv.engine_ids("sglang", "llama", [2, 15, 30], 30, SGL17), r"cannot capture h\[30\]"),
        (lambda: conv.engine_ids("sglang", "gemma3", [2, 13, 23], 26, SGL17), r"without `residual`"),
        (lambda: conv.engine_ids("vllm", "glm4_moe_lite", [2, 23, 44], 47, VLLM26), r"SupportsEagle3"),
        (lambda: conv.engine_ids("vllm", "gemma3", [2, 13, 23], 26, VLLM26), r"SupportsEagle3"),
        (lambda: conv.engine_ids("vllm", "deepseek_v2", [0, 13, 27], 27, VLLM26), r"cannot capture h\[0\]"),
        (lambda: conv.engine_ids("vllm", "llama", [2], 30, "0.27.0"), r"no layer-id rule for vllm 0.27.0"),
        (lambda: conv.engine_ids("vllm", "llama", [2], 30, "0.25.9"), r"refusing to guess"),
        (lambda: conv.engine_ids("sglang", "llama", [2], 30, "0.5.18"), r"refusing to guess"),
        (lambda: conv.engine_ids("sglang", "llama", [2], 30, "0.5.16"), r"'>=0.5.17,<0.5.18', '>=0.5.23,<0.5.24'"),
    ],
)
def test_h200_refusals(call, match):
    with pytest.raises(ConventionError, match=match):
        call()


def test_h200_draft_config_reading():
    # both runners of 0.26 read the top-level field; SGLang 0.5.17 only the nested one
    both = {"eagle_aux_hidden_state_layer_ids": [2, 15, 27], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}
    assert draft_config.read_draft_boundaries(both, "vllm", "llama", 30, VLLM26, runner="v2") == [2, 15, 27]
    assert draft_config.read_draft_boundaries(both, "vllm", "llama", 30, VLLM26, runner="v1") == [2, 15, 27]
    assert draft_config.read_draft_boundaries(both, "sglang", "llama", 30, SGL17) == [2, 15, 27]
    out = draft_config.write_draft_ids({}, "sglang", "llama", [2, 15, 27], 30, SGL17)
    out = draft_config.write_draft_ids(out, "vllm", "llama", [2, 15, 27], 30, VLLM26)
    assert out["eaglepipe"]["engines"] == {
        "sglang": {"version": SGL17, "ids": [1, 14, 26], "field": "eagle_config.eagle_aux_hidden_state_layer_ids"},
        "vllm": {"version": VLLM26, "ids": [2, 15, 27], "field": "eagle_aux_hidden_state_layer_ids"},
    }
    assert out["num_aux_hidden_states"] == 3
