"""One family from one place (TargetInfo), kimi_k2 loaded as DeepSeek-V3, refusals at the target stage with
exit code 2 and no traceback, per-engine export decided early (nearest working layer lists), 2-aux export."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eaglepipe.contract import convention, draft_config
from eaglepipe.errors import ParamsError
from eaglepipe.model.draft import DraftConfig, Eagle3Draft, save_draft
from eaglepipe.serving.export import export_all
from eaglepipe.serving.servable import plan, require_servable
from eaglepipe.target.info import materialize_target, read_info
from eaglepipe.target.tiny import LLAMA3_ROPE, build

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    src = build("kimi_k2", tmp_path_factory.mktemp("kimi_src"))
    out = tmp_path_factory.mktemp("kimi") / "target"
    return src, out, materialize_target(str(src), out)


def test_kimi_k2_loads_as_deepseek_v3(kimi):
    src, out, info = kimi
    assert json.loads((src / "config.json").read_text())["model_type"] == "kimi_k2"
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "deepseek_v3" and saved["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (info.model_type, info.family, info.source_model_type) == ("deepseek_v3", "deepseek_v3", "kimi_k2")
    assert (info.n_layers, info.hidden_size, info.vocab_size) == (6, 64, 99)
    assert info.rope["rope_type"] == "yarn" and info.rope["mscale_all_dim"] == 1.0
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)  # same weights, re-saved
    assert read_info(out, hash_weights=False).family == convention.family_of(saved) == "deepseek_v3"


def _run_target_stage(tmp_path: Path, source: Path, **extract) -> subprocess.CompletedProcess:
    """stages/target.py on ``source`` with the repository's params; ``framework=`` / ``engine=`` override them."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["target"]["source"] = str(source)
    params["framework"] = extract.pop("framework", params["framework"])
    params["extract"].update(extract)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return subprocess.run([sys.executable, str(REPO / "stages/target.py"), "out", "target.json", "unq"], cwd=tmp_path,
                          capture_output=True, text=True)


def _edit_config(folder: Path, **changes) -> Path:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "foo_bar"}, "model_type 'foo_bar' is not known to transformers"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [1.0] * 16,
                          "rope_theta": 1e4}}, "rope_type 'longrope'"),
])
def test_target_stage_refuses_with_exit_2_and_no_traceback(tmp_path, changes, message):
    src = _edit_config(build("llama", tmp_path / "src"), **changes)
    r = _run_target_stage(tmp_path, src)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


GRANITE_SGLANG = (r"framework: sglang: sglang 0\.5\.23 has no EAGLE-3 capture for GraniteForCausalLM "
                  r"\(sglang/srt/models/granite\.py defines no set_eagle3_layers_to_capture on GraniteForCausalLM "
                  r"or its bases\)\. Engines that can capture it: hf, vllm")


@pytest.mark.parametrize("name,framework,engine,refusal", [
    ("phi3", "sglang", "hf", None),  # SGLang's Phi3ForCausalLM(LlamaForCausalLM): Llama's capture, no rule of its own
    ("granite", "hf", "hf", None),  # only hf is asked: SGLang's lack of a granite capture does not matter
    ("granite", "sglang", "hf", GRANITE_SGLANG),
    ("olmo2", "vllm", "sglang", r"extract\.engine: sglang: sglang 0\.5\.23 has no EAGLE-3 capture for "
                                r"Olmo2ForCausalLM \(sglang/srt/models/olmo2\.py"),
    ("qwen2_moe", "sglang", "hf", None),  # SGLang's qwen2_moe.py: Llama's id form, so Llama's rule
    ("qwen2_moe", "vllm", "hf", r"framework: vllm: vllm [0-9.]+ has no EAGLE-3 capture for Qwen2MoeForCausalLM "
                                r"\(vllm/model_executor/models/qwen2_moe\.py"),
])
def test_target_stage_asks_only_the_engines_the_params_name(tmp_path, name, framework, engine, refusal):
    """Families no rule lists pass the target stage when the engines the params name capture them (their own
    code says so), and are refused, exit 2, naming the engine file, only for an engine the params name."""
    r = _run_target_stage(tmp_path, build(name, tmp_path / "src"), framework=framework, engine=engine)
    if refusal is None:
        assert r.returncode == 0, r.stderr
        assert json.loads((tmp_path / "target.json").read_text())["family"] == name
    else:
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert re.search(refusal, r.stderr), r.stderr
        assert not (tmp_path / "out").exists()


def test_hf_capture_needs_model_layers():
    """eaglepipe's hf hooks sit on model.model.layers: GPT-2 (transformer.h) is refused for hf, naming why;
    a phi3 config has them."""
    from transformers import AutoConfig

    from eaglepipe.target.capture_check import capture_problems

    gpt2 = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2)
    why = capture_problems(gpt2, ["hf", "vllm"])
    assert "GPT2LMHeadModel has no model.layers with its 2 decoder layers" in why["hf"]
    assert "eaglepipe/engines/hf.py" in why["hf"]
    assert capture_problems(AutoConfig.for_model("phi3", num_hidden_layers=2), ["hf", "vllm", "sglang"]) == {}


# --- serving engines decided early -------------------------------------------------------------------------


def test_plan_names_engine_rule_and_nearest_lists():
    p = plan("deepseek_v3", 8, [1, 4, 5])
    assert p["vllm"].ids == [1, 4, 5]
    s = p["sglang"]
    assert s.ids is None and s.nearest == [[2, 4, 5], [2, 3, 5], [2, 4, 6]]
    assert "ids[0] == 1" in s.reason and "sglang/srt/models/deepseek_v2.py" in s.reason
    p = plan("llama", 30, [2, 15, 30])
    assert p["sglang"].ids is None and p["sglang"].nearest[0] == [2, 15, 29]
    assert "cannot capture h[30]" in p["sglang"].reason
    assert plan("llama", 30, [2, 15, 27])["sglang"].ids == [1, 14, 26]


def test_require_servable_refuses_the_framework_engine_only():
    assert require_servable("vllm", "llama", 4, [1, 2, 4])["sglang"].ids is None  # vllm serves: no refusal
    with pytest.raises(ParamsError, match=r"sglang 0\.5\.23 cannot serve .* Nearest layer lists it can serve: "
                                          r"\[1, 2, 3\]"):
        require_servable("sglang", "llama", 4, [1, 2, 4])


@pytest.fixture
def drafter(tmp_path, tiny_target):
    cfg = DraftConfig.from_target(json.loads((tiny_target / "config.json").read_text()), n_aux=3, draft_vocab_size=99)
    save_draft(Eagle3Draft(cfg), tmp_path / "drafter")
    return tmp_path / "drafter"


def test_export_all_with_framework_vllm_writes_vllm_and_records_why_sglang_is_absent(drafter, tiny_target, tmp_path):
    out = tmp_path / "export"
    verdict = export_all(drafter, tiny_target, out, [1, 2, 4], "vllm")  # h[4] = h[N]: SGLang llama cannot
    assert (out / "vllm" / "config.json").exists() and not (out / "sglang").exists()
    rec = json.loads((out / "engines.json").read_text())
    assert rec["engines"] == json.loads(json.dumps(verdict))
    assert rec["engines"]["vllm"]["exported"] and rec["engines"]["vllm"]["ids"] == [1, 2, 4]
    sg = rec["engines"]["sglang"]
    assert not sg["exported"] and sg["nearest"] == [[1, 2, 3]] and "cannot capture h[4]" in sg["reason"]
    with pytest.raises(ParamsError, match="framework = sglang"):
        export_all(drafter, tiny_target, tmp_path / "export2", [1, 2, 4], "sglang")


def test_two_aux_export_sizes_fc_by_num_aux_hidden_states(tmp_path, tiny_target):
    cfg = DraftConfig.from_target(json.loads((tiny_target / "config.json").read_text()), n_aux=2, draft_vocab_size=99)
    save_draft(Eagle3Draft(cfg), tmp_path / "drafter")
    export_all(tmp_path / "drafter", tiny_target, tmp_path / "export", [1, 3], "vllm")
    for engine, ids in (("vllm", [1, 3]), ("sglang", [0, 2])):
        c = json.loads((tmp_path / "export" / engine / "config.json").read_text())
        assert c["num_aux_hidden_states"] == 2
        assert load_file(str(tmp_path / "export" / engine / "model.safetensors"))["fc.weight"].shape == (32, 64)
        assert draft_config.config_ids(c, engine, runner="v1")[0] == ids


def test_export_writes_the_targets_llama3_rope(tmp_path):
    target = materialize_target(str(build("llama-llama3", tmp_path / "src")), tmp_path / "target")
    assert target.rope == LLAMA3_ROPE
    cfg = DraftConfig.from_target(json.loads((tmp_path / "target" / "config.json").read_text()), 3, 99)
    save_draft(Eagle3Draft(cfg), tmp_path / "drafter")
    export_all(tmp_path / "drafter", tmp_path / "target", tmp_path / "export", [1, 2, 3], "vllm")
    for engine in ("vllm", "sglang"):
        c = json.loads((tmp_path / "export" / engine / "config.json").read_text())
        assert c["rope_parameters"] == LLAMA3_ROPE and c["rope_theta"] == 500000.0
        assert c["rope_scaling"] == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
        assert c["head_dim"] == 32 and c["max_position_embeddings"] == 512


def test_inspect_flags_a_draft_whose_rope_is_not_the_one_it_was_trained_with(tmp_path):
    """The export states the RoPE trained with (eaglepipe.rope): a config edited to another RoPE is a problem.
    Without that lineage block the same config is only a warning (the folder cannot tell how it was trained)."""
    from eaglepipe.contract.inspect import inspect_draft

    materialize_target(str(build("llama-llama3", tmp_path / "src")), tmp_path / "target")
    cfg = DraftConfig.from_target(json.loads((tmp_path / "target" / "config.json").read_text()), 3, 99)
    save_draft(Eagle3Draft(cfg), tmp_path / "drafter")
    export_all(tmp_path / "drafter", tmp_path / "target", tmp_path / "export", [1, 2, 3], "vllm")
    rep = inspect_draft(tmp_path / "export" / "vllm", tmp_path / "target")
    assert rep.ok and rep.warnings == []
    path = tmp_path / "export" / "vllm" / "config.json"
    c = json.loads(path.read_text())
    assert c["eaglepipe"]["rope"] == cfg.rope == LLAMA3_ROPE
    c.update(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_scaling=None)
    path.write_text(json.dumps(c))
    rep = inspect_draft(tmp_path / "export" / "vllm", tmp_path / "target")
    assert not rep.ok and any("differs from the one it was trained with" in p and "'llama3'" in p
                              for p in rep.problems)
    c.pop("eaglepipe")
    path.write_text(json.dumps(c))
    rep = inspect_draft(tmp_path / "export" / "vllm", tmp_path / "target")
    assert rep.ok and len(rep.warnings) == 1 and "differs from the target's" in rep.warnings[0]


def test_extract_uses_the_targets_family_on_kimi_k2(kimi, tmp_path):
    from eaglepipe.data.extract import extract
    from eaglepipe.data.features import FeatureSet
    from eaglepipe.params import ExtractParams

    _, target, info = kimi
    convs = [{"id": f"c{i}", "messages": [{"role": "user", "content": "hi there " * (i + 1)},
                                          {"role": "assistant", "content": "ok then"}]} for i in range(2)]
    p = ExtractParams(engine="hf", regenerate=False, batch_size=2, max_length=64, dtype="float32", shard_size=2)
    manifest, stats = extract(convs, target, info, [2, 3, 4], p, tmp_path / "f", tmp_path / "s", "x")
    assert manifest["target"]["family"] == "deepseek_v3" and manifest["target"]["model_type"] == "deepseek_v3"
    assert manifest["capture_ids"] == [2, 3, 4, 6] and stats.samples == 2
    assert FeatureSet(tmp_path / "f").layers == [2, 3, 4]


def test_readme_support_matrix_is_rendered_from_the_json():
    r = subprocess.run([sys.executable, str(REPO / "scripts/render_support_matrix.py"), "--check"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads((REPO / "metrics/support_matrix.json").read_text())
    statuses = {r["status"] for r in doc["rows"]}
    assert statuses <= {"verified", "refused", "not_run"}
    assert all(r["reason"] for r in doc["rows"] if r["status"] != "verified")
    vllm = {r["target"]: r for r in doc["rows"] if r["engine"] == "vllm"}
    assert sorted(vllm) == sorted(["llama", "llama-llama3", "qwen2", "qwen3", "mistral", "gpt_oss", "deepseek_v3",
                                   "kimi_k2", "qwen2-yarn", "phi3", "granite", "olmo2", "qwen3_moe", "gemma3",
                                   "qwen2_moe", "kimi_k25", "qwen2_5_vl", "llama-w8a8", "llama-fp8"])
    served = {t: r for t, r in vllm.items() if t not in ("gemma3", "qwen2_moe", "qwen2_5_vl")}
    assert all(r["status"] == "verified" and r["offset"] == 0 and r["min_cosine"] >= 0.999 for r in served.values())
    # families no rule lists: each engine's own code decides, and a refusal names the engine file
    rows = {(r["target"], r["engine"]): r for r in doc["rows"]}
    # wrappers and pre-quantized checkpoints: the hf engine refuses a checkpoint it would not run as served
    for name in ("llama-w8a8", "llama-fp8"):
        assert rows[(name, "hf")]["status"] == "refused" and "compressed-tensors" in rows[(name, "hf")]["reason"]
    assert "torchvision" in rows[("qwen2_5_vl", "vllm")]["reason"] and rows[("qwen2_5_vl", "hf")]["ids"] == [2, 3, 4]
    assert not any("support_matrix_" in r["reason"] for r in doc["rows"] if r["reason"])
    assert rows[("phi3", "sglang")]["status"] == "verified" and rows[("phi3", "sglang")]["ids"] == [1, 2, 3]
    for name in ("granite", "olmo2"):
        assert rows[(name, "sglang")]["status"] == "refused"
        why = rows[(name, "sglang")]["reason"]
        assert f"sglang/srt/models/{name}.py defines no set_eagle3_layers_to_capture" in why
    assert {rows[("gemma3", e)]["status"] for e in ("hf", "vllm", "sglang")} == {"refused"}
    assert "SupportsEagle3" in rows[("gemma3", "vllm")]["reason"]
    assert "without `residual`" in rows[("gemma3", "sglang")]["reason"]
    # qwen2_moe: vLLM's class has no capture; SGLang's takes Llama's rule by its id form (run only on CUDA)
    assert rows[("qwen2_moe", "hf")]["status"] == "verified"
    assert "vllm/model_executor/models/qwen2_moe.py Qwen2MoeForCausalLM does not implement SupportsEagle3" in \
        rows[("qwen2_moe", "vllm")]["reason"]
    assert rows[("qwen2_moe", "sglang")]["status"] in ("verified", "not_run")


def test_export_refuses_a_draft_trained_with_another_rope(drafter, tmp_path):
    from eaglepipe.errors import ExportError
    from eaglepipe.serving.export import export_draft

    target = materialize_target(str(build("llama-llama3", tmp_path / "src")), tmp_path / "target")
    assert target.rope["rope_type"] == "llama3"
    with pytest.raises(ExportError, match="trained with RoPE .*'default'.* target's is .*'llama3'"):
        export_draft(drafter, tmp_path / "target", "vllm", tmp_path / "out", [1, 2, 3], "0.32.0")


def test_full_vocab_draft_exports_without_d2t_for_vllm_only(tmp_path, tiny_target):
    cfg = DraftConfig.from_target(json.loads((tiny_target / "config.json").read_text()), 3, draft_vocab_size=99)
    assert cfg.draft_vocab_size == cfg.vocab_size == 99
    save_draft(Eagle3Draft(cfg), tmp_path / "drafter")
    export_all(tmp_path / "drafter", tiny_target, tmp_path / "export", [1, 2, 3], "vllm")
    assert "d2t" not in load_file(str(tmp_path / "export" / "vllm" / "model.safetensors"))
    sg = load_file(str(tmp_path / "export" / "sglang" / "model.safetensors"))
    assert not sg["d2t"].any() and bool(sg["t2d"].all())  # SGLang reads d2t as hot_token_id = arange + d2t
