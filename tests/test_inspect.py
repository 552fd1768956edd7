"""`eaglepipe inspect` on synthetic draft folders in every format found in the wild.

Target: a tiny llama, N = 8, hidden 16, vocab 64 (engine default = h[2], h[4], h[5]).
Draft: hidden 16, draft vocab 8, 3 aux states → fc [16, 48].
"""

import json

import numpy as np
import pytest

from eaglepipe.cli import main
from eaglepipe.contract import convention as conv
from eaglepipe.contract import draft_config
from eaglepipe.contract.inspect import format_report, inspect_draft

safetensors_numpy = pytest.importorskip("safetensors.numpy")

VERSIONS = {"sglang": "0.5.23", "vllm": "0.32.0"}
TARGET = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 16, "vocab_size": 64}
TARGET_IDS = np.array([0, 3, 5, 9, 10, 20, 40, 63])  # draft token j → target token TARGET_IDS[j]
LLAMA_FIELDS = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64}


def write_draft(path, config, n_aux=3, d2t="offsets", draft_vocab=8, extra=()):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    tensors = {
        **{name: np.ones(shape, np.float32) for name, shape in extra},
        "fc.weight": np.zeros((16, 16 * n_aux), np.float32),
        "lm_head.weight": np.zeros((draft_vocab, 16), np.float32),
        "norm.weight": np.ones(16, np.float32),
    }
    if d2t == "offsets":
        tensors["d2t"] = TARGET_IDS - np.arange(8)  # target_id = draft_id + d2t[draft_id]
    elif d2t == "absolute":
        tensors["d2t"] = TARGET_IDS.copy()  # a common bug: target ids stored instead of offsets
    elif d2t == "identity":
        tensors["d2t"] = np.zeros(draft_vocab, np.int64)
    t2d = np.zeros(64, bool)
    t2d[TARGET_IDS if d2t != "identity" else np.arange(64)] = True
    tensors["t2d"] = t2d
    safetensors_numpy.save_file(tensors, str(path / "model.safetensors"))
    return path


def eaglepipe_config(boundaries=(2, 4, 7)):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 8, "target_hidden_size": 16, **LLAMA_FIELDS}
    for engine in ("sglang", "vllm"):
        cfg = draft_config.write_draft_ids(cfg, engine, "llama", list(boundaries), 8, VERSIONS[engine])
    return cfg


def test_eaglepipe_export_is_ok(tmp_path):
    draft = write_draft(tmp_path / "d", eaglepipe_config())
    r = inspect_draft(draft, TARGET, VERSIONS)
    assert (r.draft_format, r.family, r.n_layers, r.target_hidden) == ("eaglepipe", "llama", 8, 16)
    assert (r.engines["sglang"].ids, r.engines["sglang"].boundaries) == ([1, 3, 6], [2, 4, 7])
    assert (r.engines["vllm"].ids, r.engines["vllm"].boundaries) == ([2, 4, 7], [2, 4, 7])
    assert r.engines["sglang"].architecture == "LlamaForCausalLMEagle3"
    assert r.engines["vllm"].architecture == "LlamaForCausalLMEagle3"  # registry entry → Eagle3LlamaForCausalLM class
    assert (r.engines["sglang"].fc_states, r.engines["vllm"].fc_states) == (3, 3)
    assert r.agree is True and r.stated_boundaries == [2, 4, 7]
    assert r.fc_shape == (16, 48)
    assert r.d2t == "offsets, 8 draft tokens"
    assert r.problems == [] and r.ok
    text = format_report(r)
    assert "sglang  0.5.23   arch=LlamaForCausalLMEagle3  eagle_config.eagle_aux_hidden_state_layer_ids = [1, 3, 6]  → feeds h[2, 4, 7]" in text
    assert text.splitlines()[-1] == "OK"


def test_specforge_nested_ids_only(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 8, **LLAMA_FIELDS,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}}
    r = inspect_draft(write_draft(tmp_path / "d", cfg), TARGET, VERSIONS)
    assert r.draft_format == "sglang/specforge"
    assert r.engines["sglang"].boundaries == [2, 4, 7]
    assert r.engines["vllm"].boundaries == [2, 4, 5]  # V2 runner: nested ids ignored → default
    assert r.agree is False and not r.ok
    assert r.problems == ["SGLang feeds h[2, 4, 7], vLLM feeds h[2, 4, 5]: one of them serves other features"]
    assert r.engines["vllm"].problems == [
        "vLLM runners disagree: V1 reads eagle_config.eagle_aux_hidden_state_layer_ids = [1, 3, 6] → h[1, 3, 6], "
        "V2 (default on CUDA) uses its default h[2, 4, 5]; write eagle_aux_hidden_state_layer_ids at the top level",
        "no ids where vllm reads them: it silently feeds its default h[2, 4, 5]",  # the engines disagree: a fact
    ]


def test_modelopt_format_on_deepseek_target(tmp_path):
    target = {"model_type": "deepseek_v3", "num_hidden_layers": 8, "hidden_size": 16, "vocab_size": 64}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 8, **LLAMA_FIELDS,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6], "use_aux_hidden_state": True,
                            "use_input_layernorm_in_first_layer": True, "use_last_layernorm": False}}
    r = inspect_draft(write_draft(tmp_path / "d", cfg), target, VERSIONS)
    assert (r.draft_format, r.family) == ("modelopt", "deepseek_v3")
    assert r.engines["sglang"].boundaries == [2, 4, 7]  # first id == 1: SGLang's DeepSeek heuristic adds 1


def test_speculators_format(tmp_path):
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 8,
           "target_hidden_size": 16, "eagle_aux_hidden_state_layer_ids": [2, 4, 7],
           "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}], "verifier": {"name_or_path": "t"}},
           "transformer_layer_config": {"model_type": "llama", **LLAMA_FIELDS}}
    r = inspect_draft(write_draft(tmp_path / "d", cfg), TARGET, VERSIONS)
    assert r.draft_format == "speculators"
    assert r.engines["vllm"].architecture == "Eagle3LlamaForCausalLM"  # speculators algos.py: model_type llama
    assert (r.engines["vllm"].field, r.engines["vllm"].boundaries, r.engines["vllm"].fc_states) == (
        "eagle_aux_hidden_state_layer_ids", [2, 4, 7], 3)
    assert r.engines["vllm"].problems == []
    sgl = r.engines["sglang"]  # one verdict: refused, so no ids, boundaries or fc read for it
    assert (sgl.architecture, sgl.ids, sgl.boundaries, sgl.fc_states, sgl.problems) == (None, None, None, None, [])
    assert sgl.refused.startswith("sglang 0.5.23 does not load architectures ['Eagle3Speculator']")
    assert r.agree is None and r.ok  # vLLM serves it as written; SGLang's refusal is its verdict, not a problem


def test_original_eagle_config_without_ids(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "draft_vocab_size": 8, **LLAMA_FIELDS}
    r = inspect_draft(write_draft(tmp_path / "d", cfg), TARGET, VERSIONS)
    assert r.draft_format == "eagle"
    assert r.engines["vllm"].architecture == "Eagle3LlamaForCausalLM"  # EAGLEConfig prefixes "Eagle3"
    assert r.engines["sglang"].architecture is None and r.engines["sglang"].boundaries is None
    assert r.engines["vllm"].boundaries == [2, 4, 5] and r.engines["vllm"].problems == []
    assert r.agree is None and r.ok and r.warnings == []
    assert "vllm: no ids written; it feeds its default h[2, 4, 5]" in r.notes
    assert format_report(r).splitlines()[-1] == "OK for vllm only (sglang refuses it)"


def test_fc_width_disagrees_with_ids(tmp_path):
    r = inspect_draft(write_draft(tmp_path / "d", eaglepipe_config(), n_aux=4), TARGET, VERSIONS)
    assert r.fc_shape == (16, 64)
    assert r.engines["vllm"].problems == [
        "vllm feeds 3 states: fc takes 64 input features but 3 aux states × hidden 16 = 48; the weights imply 4 aux states"
    ]


def test_d2t_absolute_ids_and_identity(tmp_path):
    r = inspect_draft(write_draft(tmp_path / "a", eaglepipe_config(), d2t="absolute"), TARGET, VERSIONS)
    assert r.problems == [
        "d2t: arange + d2t spans [0, 70], outside [0, 64)",
        "d2t: d2t looks like absolute target ids; engines add it to the draft id (offsets)",
    ]
    full = {**eaglepipe_config(), "draft_vocab_size": 64}
    r = inspect_draft(write_draft(tmp_path / "i", full, d2t="identity", draft_vocab=64), TARGET, VERSIONS)
    assert r.d2t == "identity (all zeros)" and r.ok


def test_cli_exit_codes(tmp_path, capsys):
    target = tmp_path / "target.json"
    target.write_text(json.dumps(TARGET))
    good = write_draft(tmp_path / "good", eaglepipe_config())
    bad = write_draft(tmp_path / "bad", eaglepipe_config(), n_aux=4)
    pins = ["--sglang-version", "0.5.23", "--vllm-version", "0.32.0"]
    assert main(["inspect", str(good), "--target", str(target), *pins]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "OK"
    assert main(["inspect", str(bad), "--target", str(target), *pins]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "2 problem(s)"
    assert main(["inspect", str(good), "--target", str(target), "--json", *pins]) == 0
    assert json.loads(capsys.readouterr().out)["engines"]["sglang"]["ids"] == [1, 3, 6]
    assert main(["inspect", str(tmp_path / "missing"), "--target", str(target)]) == 2
    assert "config.json: not found" in capsys.readouterr().err
    trained = tmp_path / "drafter"  # train_drafter's output (data/drafter): refused, the export named
    trained.mkdir()
    (trained / "config.json").write_text(json.dumps({"draft": {"hidden_size": 32}, "layers": [1, 3, 6]}))
    assert main(["inspect", str(trained), "--target", str(target)]) == 2
    err = capsys.readouterr().err
    assert "train_drafter's output (trained on h[1, 3, 6])" in err and "data/export/vllm" in err


def test_export_for_vllm_only_is_not_an_sglang_problem(tmp_path):
    """h[0] (the embeddings) cannot be expressed for SGLang's llama (+1 rule, negative ids refused): export
    writes only vLLM's ids. inspect must not call SGLang's default-layer collapse a problem of that folder."""
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 8, "target_hidden_size": 16, **LLAMA_FIELDS}
    cfg = draft_config.write_draft_ids(cfg, "vllm", "llama", [0, 4, 7], 8, VERSIONS["vllm"])
    with pytest.raises(conv.ConventionError):
        draft_config.write_draft_ids(cfg, "sglang", "llama", [0, 4, 7], 8, VERSIONS["sglang"])
    r = inspect_draft(write_draft(tmp_path / "d", cfg), TARGET, VERSIONS)
    assert r.engines["vllm"].boundaries == [0, 4, 7] and r.engines["vllm"].served
    assert not r.engines["sglang"].served and r.engines["sglang"].problems == []
    assert any(n.startswith("sglang: this eaglepipe export wrote no ids for sglang") for n in r.notes)
    assert r.problems == [] and r.ok
    # the same folder without the eaglepipe block (a foreign draft) still reports SGLang's silent default
    foreign = {k: v for k, v in cfg.items() if k != "eaglepipe"}
    r2 = inspect_draft(write_draft(tmp_path / "f", foreign), TARGET, VERSIONS)
    assert not r2.ok and any("silently feeds its default" in p for p in r2.engines["sglang"].problems)


# --- public drafts on tiny targets: a fact vs a guess ------------------------------------------------------
# The configs below keep the keys and relations of two public Llama-3.1-8B EAGLE-3 drafts; sizes are scaled
# to a tiny llama3-RoPE target (eaglepipe.target.tiny "llama-llama3", N = 32 like Llama-3.1-8B, hidden 64,
# vocab 99), so the weights can be written and checked too. Both engines' default for N = 32: h[2, 16, 29].

# SpecForge configs/llama3-8B-eagle3.json, verbatim: no rope fields (so rope_theta 10000, no llama3 scaling,
# while the target has them), no eagle_config, ids nowhere, draft_vocab_size 32000 of 128256.
SPECFORGE_LLAMA31_8B = {
    "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 2048,
    "model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 1,
    "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.28.1", "use_cache": True, "vocab_size": 128256, "draft_vocab_size": 32000,
}
SCALED = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
          "vocab_size": 99, "bos_token_id": 1, "eos_token_id": 2, "draft_vocab_size": 8}


def speculators_llama31_8b(target_rope: dict) -> dict:
    """A speculators ``Eagle3Speculator`` config (speculators' converter template, as RedHatAI's Llama-3.1-8B
    speculator): llama fields in ``transformer_layer_config`` with the target's llama3 RoPE, no aux ids."""
    return {
        "architectures": ["Eagle3Speculator"], "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
        "draft_vocab_size": 8, "has_no_defaults_at_init": False, "norm_before_residual": True,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}},
        "speculators_model_type": "eagle3", "speculators_version": "0.1.0.dev14", "target_hidden_size": None,
        "torch_dtype": "float32",
        "transformer_layer_config": {
            "attention_bias": False, "attention_dropout": 0.0, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
            "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 512, "mlp_bias": False,
            "model_type": "llama", "num_attention_heads": 2, "num_hidden_layers": 1, "num_key_value_heads": 1,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": target_rope["rope_theta"],
            "rope_scaling": {k: v for k, v in target_rope.items() if k != "rope_theta"}, "use_cache": True,
            "vocab_size": 99},
        "transformers_version": "4.52.4",
    }


@pytest.fixture(scope="module")
def llama3_target(tmp_path_factory):
    from eaglepipe.target.tiny import build

    return build("llama-llama3", tmp_path_factory.mktemp("t") / "llama3", num_hidden_layers=32)


def write_scaled_draft(path, config):
    """``config`` with weights for the tiny target: fc [64, 3·64], lm_head [8, 64], d2t offsets into 99 tokens."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    target_ids = np.array([0, 3, 5, 9, 10, 20, 40, 98])
    t2d = np.zeros(99, bool)
    t2d[target_ids] = True
    safetensors_numpy.save_file({"fc.weight": np.zeros((64, 192), np.float32), "norm.weight": np.ones(64, np.float32),
                                 "lm_head.weight": np.zeros((8, 64), np.float32), "d2t": target_ids - np.arange(8),
                                 "t2d": t2d}, str(path / "model.safetensors"))
    return path


def test_specforge_draft_rope_is_a_warning_and_agreed_defaults_a_note(tmp_path, llama3_target):
    """The draft's rope_theta 10000 vs the target's llama3 RoPE: engines build the draft's RoPE from its own
    config, so whether it is right depends on how it was trained, which its folder does not say: a warning,
    exit 0. No ids anywhere, both engines feed h[2, 16, 29]: information."""
    draft = write_scaled_draft(tmp_path / "specforge", {**SPECFORGE_LLAMA31_8B, **SCALED})
    r = inspect_draft(draft, llama3_target, VERSIONS)
    assert (r.draft_format, r.n_layers, r.agree, r.fc_shape) == ("sglang/specforge", 32, True, (64, 192))
    for v in r.engines.values():
        assert (v.field, v.boundaries, v.problems, v.refused) == (None, [2, 16, 29], [], None)
    assert r.problems == [] and r.ok
    assert r.notes == ["sglang: no ids written; it feeds its default h[2, 16, 29], as vllm does",
                       "vllm: no ids written; it feeds its default h[2, 16, 29], as sglang does"]
    assert len(r.warnings) == 1
    assert r.warnings[0].startswith("draft RoPE {'rope_theta': 10000.0, 'rope_type': 'default'} differs from the "
                                    "target's {'factor': 8.0")
    assert "'rope_type': 'llama3'" in r.warnings[0] and "cannot be read from its folder" in r.warnings[0]
    text = format_report(r)
    assert "PROBLEM" not in text and text.splitlines()[-1] == "OK, 1 warning(s)"


def test_cli_exits_0_on_public_drafts_with_warnings_only(tmp_path, llama3_target, capsys):
    """`eaglepipe inspect` on the verbatim SpecForge config (no weights) and on a speculators folder."""
    verbatim = tmp_path / "specforge"
    verbatim.mkdir()
    (verbatim / "config.json").write_text(json.dumps(SPECFORGE_LLAMA31_8B))
    pins = ["--sglang-version", "0.5.23", "--vllm-version", "0.32.0"]
    assert main(["inspect", str(verbatim), "--target", str(llama3_target), *pins]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "OK, 1 warning(s)" and sum(ln.startswith("WARNING  draft RoPE") for ln in out) == 1
    assert main(["inspect", str(verbatim), "--target", str(llama3_target), "--json", *pins]) == 0
    assert len(json.loads(capsys.readouterr().out)["warnings"]) == 1


def test_speculators_folder_has_one_verdict_per_engine(tmp_path, llama3_target, capsys):
    """SGLang refuses Eagle3Speculator: its line says so and nothing else (no ids, no "feeds"); vLLM rebuilds it
    as Eagle3LlamaForCausalLM and feeds its default; the RoPE is the target's. Exit 0."""
    target_rope = json.loads((llama3_target / "config.json").read_text())["rope_parameters"]
    draft = write_scaled_draft(tmp_path / "speculators", speculators_llama31_8b(target_rope))
    r = inspect_draft(draft, llama3_target, VERSIONS)
    assert r.draft_format == "speculators" and r.ok and r.warnings == [] and r.problems == []
    assert r.engines["sglang"].refused and r.engines["sglang"].boundaries is None
    assert (r.engines["vllm"].architecture, r.engines["vllm"].boundaries) == ("Eagle3LlamaForCausalLM", [2, 16, 29])
    assert r.notes == ["vllm: no ids written; it feeds its default h[2, 16, 29]",
                       "EAGLE-3.1 variant: norm_before_residual"]  # vLLM's speculators algos.py: on unless stated
    assert main(["inspect", str(draft), "--target", str(llama3_target), "--sglang-version", "0.5.23",
                 "--vllm-version", "0.32.0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    sgl = [ln for ln in lines if ln.startswith("sglang ")]
    assert sgl == ["sglang  0.5.23   REFUSED: does not load architectures ['Eagle3Speculator'] as an EAGLE-3 draft; "
                   "accepted: ['LlamaForCausalLMEagle3', 'Eagle3DeepseekV2ForCausalLM']"]
    assert any(ln.startswith("vllm    0.32.0   arch=Eagle3LlamaForCausalLM  no ids (default)  → feeds h[2, 16, 29]")
               for ln in lines)
    assert lines[-1] == "OK for vllm only (sglang refuses it)"


def test_no_engine_loading_the_draft_is_a_problem(tmp_path):
    cfg = {"architectures": ["MistralForCausalLM"], "draft_vocab_size": 8, **LLAMA_FIELDS}
    r = inspect_draft(write_draft(tmp_path / "d", cfg), TARGET, VERSIONS)
    assert not r.ok and r.problems[0].startswith("no engine loads this draft: sglang 0.5.23 does not load")
    assert "vllm 0.32.0 does not load architectures ['MistralForCausalLM']" in r.problems[0]


def test_eagle31_flags_each_engine_reads(tmp_path):
    """speculators' default EAGLE-3.1 flags in an eaglepipe-style folder: vLLM reads them all; SGLang does not read
    norm_before_residual (a problem: it would serve another draft); the norm tensors must match the flags."""
    flags = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}
    r = inspect_draft(write_draft(tmp_path / "a", {**eaglepipe_config(), **flags}, extra=[("input_norm.weight", 48)]),
                      TARGET, VERSIONS)
    assert "EAGLE-3.1 variant: norm_before_fc, norm_before_residual, norm_output" in r.notes
    assert r.problems == ["sglang: sglang 0.5.23 does not read norm_before_residual (srt/models/llama_eagle3.py "
                          "LlamaDecoderLayer keeps the raw residual): it would serve another draft than the one "
                          "trained, silently"]
    r = inspect_draft(write_draft(tmp_path / "b", {**eaglepipe_config(), "norm_before_fc": True}), TARGET, VERSIONS)
    assert r.problems == ["norm_before_fc is set but the weights hold no input_norm.weight: the engines would start "
                          "it at ones"]
    r = inspect_draft(write_draft(tmp_path / "c", eaglepipe_config(), extra=[("fc_norm.0.weight", 16)]),
                      TARGET, VERSIONS)
    assert r.problems == ["the weights hold fc_norm.0.weight but the config does not set fc_norm: the engines ignore "
                          "the tensor and serve the draft without the norm it was trained with"]
    r = inspect_draft(write_draft(tmp_path / "d", {**eaglepipe_config(), "eagle_config": {
        **eaglepipe_config()["eagle_config"], "norm_before_fc": True}, "norm_output": True},
        extra=[("input_norm.weight", 48)]), TARGET, VERSIONS)
    assert r.ok and "EAGLE-3.1 variant: norm_before_fc, norm_output" in r.notes  # both engines read these
