"""Multimodal wrapper targets (a config with a ``text_config``): Qwen2.5-VL and the seeds' Kimi-K2.5.

The layer rules of a wrapper come from each engine's own code (vLLM hands the ids to the language model its
wrapper builds; SGLang's wrapper has its own setter), the hf engine and the training read the wrapper's language
model, and the whole pipeline runs on a tiny Kimi-K2.5-shaped checkpoint through vLLM on the CPU.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from eaglepipe.contract import capture_code, capture_support
from eaglepipe.contract import convention as conv
from eaglepipe.contract.inspect import inspect_draft
from eaglepipe.target.tiny import build_kimi_k25, build_qwen2_5_vl

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    return build_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "t")


@pytest.fixture(scope="module")
def kimi_k25(tmp_path_factory):
    return build_kimi_k25(tmp_path_factory.mktemp("kimi_k25") / "t")


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_vllm_reads_a_wrapper_by_the_language_model_it_builds(version):
    cap = capture_support.lookup("vllm", version, "qwen2_5_vl")
    assert (cap.architecture, cap.language_model) == ("Qwen2_5_VLForConditionalGeneration", "Qwen2ForCausalLM")
    rule = conv.rule_for("vllm", "qwen2_5_vl", version)
    assert rule.meaning == "id i = h[i]"
    assert "qwen2_5_vl.py" in rule.source and "Qwen2ForCausalLM" in rule.source
    assert conv.engine_ids("vllm", "qwen2_5_vl", [1, 3, 5], 6, version) == [1, 3, 5]


def test_sglang_reads_a_wrapper_by_its_own_setter():
    rule = conv.rule_for("sglang", "qwen2_5_vl", "0.5.23")
    assert rule.meaning == "id i = h[i+1]" and "sglang/srt/models/qwen2_5_vl.py" in rule.source
    assert conv.engine_ids("sglang", "qwen2_5_vl", [1, 3, 5], 6, "0.5.23") == [0, 2, 4]


def test_the_scan_finds_the_language_model_only_where_the_code_names_it():
    src = ("class W:\n    def __init__(self, c):\n        self.language_model = init_vllm_registered_model(\n"
           "            vllm_config=c, prefix='language_model', architectures=[{}])\n")
    assert capture_code.language_model(ast.parse(src.format('"Qwen2ForCausalLM"')), "W") == "Qwen2ForCausalLM"
    assert capture_code.language_model(ast.parse(src.format("c.arch")), "W") is None  # decided at run time
    assert capture_code.language_model(ast.parse(src.format('"X"')), "Other") is None


def test_the_seeds_kimi_k25_config_gives_each_engine_its_boundaries(tmp_path):
    """Kimi-K2.5 as shipped: a wrapper (61 layers in text_config, model_type kimi_k2) and a SpecForge draft on ids
    [2, 30, 58]: both engines feed h[2], h[30], h[58] (SGLang's DeepSeek guess adds 1 only when the first id is 1)."""
    text = {"model_type": "kimi_k2", "num_hidden_layers": 61, "hidden_size": 16, "vocab_size": 64,
            "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    target = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
              "vision_config": {"hidden_size": 32}}
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "vocab_size": 64, "draft_vocab_size": 64, "target_hidden_size": 16,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}))
    r = inspect_draft(draft, target, {"sglang": "0.5.23", "vllm": "0.32.0"})
    assert (r.family, r.n_layers) == ("kimi_k25", 61)
    assert r.engines["sglang"].boundaries == r.engines["vllm"].boundaries == [2, 30, 58]
    assert r.agree is True
    # a draft of ids [1, 30, 58] is where SGLang's guess bites: it reads h[2], h[31], h[59]
    assert conv.boundaries_of("sglang", "kimi_k25", [1, 30, 58], 61, "0.5.23") == [2, 31, 59]
    assert conv.boundaries_of("vllm", "kimi_k25", [1, 30, 58], 61, "0.32.0") == [1, 30, 58]


@pytest.mark.parametrize("wrapper", ["qwen_vl", "kimi_k25"])
def test_hf_engine_hooks_the_wrappers_language_model(wrapper, request):
    from eaglepipe.engines.hf import HFEngine
    from eaglepipe.model.target_head import load_target_head
    from eaglepipe.target.hf_model import decoder, load_model
    from eaglepipe.target.info import read_info

    folder = request.getfixturevalue(wrapper)
    info = read_info(folder, hash_weights=False)
    assert info.n_layers == 6 and info.hidden_size == 64
    seq = [5, 9, 12, 30, 40, 7, 8]
    with HFEngine(folder, info=info) as engine:
        got = engine.capture([seq], [0, 3])[0]  # (T, 2, H)
    model = load_model(folder, torch.float32).eval()
    with torch.no_grad():  # the wrapper's own forward, text only: its hidden_states are the language model's
        hs = model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
    assert torch.allclose(got[:, 0], hs[0][0]) and torch.allclose(got[:, 1], hs[3][0])
    head = load_target_head(folder)
    lm = decoder(model)
    assert torch.equal(head.embed, lm.embed_tokens.weight) and torch.equal(head.lm_head, model.lm_head.weight)
    assert torch.equal(head.norm_weight, lm.norm.weight) and head.eps == lm.config.rms_norm_eps


@pytest.mark.slow
@pytest.mark.vllm
def test_dvc_repro_on_a_kimi_k25_wrapper_through_vllm(tmp_path, kimi_k25):
    """The seeds' kind of target, tiny: extraction and the gate through vLLM (offset 0 at every layer), training,
    export, and serve_eval (reference τ; vLLM's CPU backend cannot serve an MLA target with a draft: recorded)."""
    from test_pipeline import dvc, tiny_repo

    pytest.importorskip("vllm")
    cwd = tiny_repo(tmp_path / "repo", kimi_k25, {"engine": "vllm", "max_length": 96})
    r = dvc(cwd, "repro")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    offsets = json.loads((cwd / "metrics/offsets.json").read_text())
    assert offsets["verdict"] == "ok" and set(offsets["offset"].values()) == {0}, offsets
    assert offsets["min_cosine_at_0"] >= 0.999
    engines = json.loads((cwd / "data/export/engines.json").read_text())["engines"]
    assert engines["vllm"]["ids"] == [1, 2, 3], engines
    # the seeds' trap, named at export: SGLang reads ids starting at 1 as h[i + 1] for DeepSeek/Kimi
    assert not engines["sglang"]["exported"] and "deepseek_v2.py" in engines["sglang"]["reason"]
    report = json.loads((cwd / "reports/serve_eval.json").read_text())
    assert report["reference"]["outputs_equal"] and report["reference"]["tau"] >= 1.0
    if not torch.cuda.is_available():
        assert "cpu_mla.py" in report["vllm"]["skipped"]


def test_the_target_stage_takes_a_qwen_vl_wrapper_for_both_engines(tmp_path, qwen_vl):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        **yaml.safe_load((REPO / "params.yaml").read_text()), "framework": "vllm",
        "target": {**yaml.safe_load((REPO / "params.yaml").read_text())["target"], "source": str(qwen_vl)}}))
    r = subprocess.run([sys.executable, str(REPO / "stages/target.py"), "out", "target.json", "unq"], cwd=tmp_path,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads((tmp_path / "target.json").read_text())
    assert (info["family"], info["n_layers"], info["model_type"]) == ("qwen2_5_vl", 6, "qwen2_5_vl_text")
