"""params.yaml validation: one clear message naming the key, the bad value and what is allowed."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglepipe.errors import ParamsError
from eaglepipe.params import check_layers_against_target, load_params, parse_params

REPO = Path(__file__).resolve().parents[1]


def defaults() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text())


def test_repo_params_are_valid():
    p = load_params(REPO / "params.yaml")
    assert p.layers == [2, 15, 27] and p.framework == "vllm" and p.extract.engine == "hf"
    assert p.validate_.search == 2


def test_gpu_profile_merges_into_valid_params():
    """profiles/gpu.yaml over params.yaml (as scripts/gpu_run.sh merges it): valid, and what issue 13 runs."""
    from scripts.run_stages import merge_profile

    p = parse_params(merge_profile(defaults(), yaml.safe_load((REPO / "profiles" / "gpu.yaml").read_text())))
    assert (p.framework, p.extract.regenerate_engine, p.extract.store, p.extract.engine) == ("vllm", "vllm", "tokens", "hf")
    assert p.prompts.max_records == 0 and p.serve.prompts == 80 and p.serve.batch_sizes == [1, 8]


def test_topics_profile_merges_after_the_gpu_profile():
    """profiles/synthetic_topics.yaml after profiles/gpu.yaml (GPU_PROFILES): only prompts.synthetic_topics moves."""
    from scripts.run_stages import merge_profile

    gpu = merge_profile(defaults(), yaml.safe_load((REPO / "profiles" / "gpu.yaml").read_text()))
    base = parse_params(copy.deepcopy(gpu))
    p = parse_params(merge_profile(gpu, yaml.safe_load((REPO / "profiles" / "synthetic_topics.yaml").read_text())))
    assert len(p.prompts.synthetic_topics) == 10 and base.prompts.synthetic_topics == []
    assert p.model_copy(update={"prompts": base.prompts}) == base
    assert p.prompts.model_copy(update={"synthetic_topics": []}) == base.prompts


@pytest.mark.parametrize("patch,expect", [
    ({"layerz": [1]}, "unknown key 'layerz'"),
    ({"extract": {"engine": "tgi"}}, "'extract.engine' = 'tgi': Input should be 'hf', 'vllm' or 'sglang'"),
    ({"framework": "trt"}, "'framework' = 'trt'"),
    ({"layers": []}, "'layers' = []: is empty"),
    ({"layers": [2, 2, 27]}, "has duplicates"),
    ({"layers": [15, 2, 27]}, "is not ascending"),
    ({"layers": [-1, 2]}, "negative boundary"),
    ({"train": {"ttt_steps": 0}}, "'train.ttt_steps' = 0: Input should be greater than or equal to 1"),
    ({"validate": {"serch": 2}}, "unknown key 'validate.serch'"),
    ({"serve": {"batch_sizes": [1, 0]}}, "'serve.batch_sizes.1' = 0: Input should be greater than or equal to 1"),
    ({"extract": {"regenerate_engine": "tgi"}}, "'extract.regenerate_engine' = 'tgi'"),
])
def test_bad_params_are_named(patch, expect):
    raw = defaults()
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(raw.get(k), dict):
            raw[k] = {**raw[k], **v}
        else:
            raw[k] = v
    with pytest.raises(ParamsError) as e:
        parse_params(raw)
    assert expect in str(e.value)


def test_layers_outside_target():
    check_layers_against_target([0, 15, 29], 30)
    with pytest.raises(ParamsError, match=r"\[31\] outside \[0, 29\]"):
        check_layers_against_target([2, 15, 31], 30)


def test_layer_n_is_refused_the_teacher_captures_it():
    """h[N] is captured anyway for the target-head teacher: as an aux layer too, extract would capture it twice."""
    with pytest.raises(ParamsError) as e:
        check_layers_against_target([0, 15, 30], 30)
    assert str(e.value) == (
        "params.yaml: 'layers' = [0, 15, 30]: h[30] is the last layer's output (N = 30), which extract captures "
        "anyway as the teacher's input (final norm -> lm_head), so it cannot also be an aux layer; the largest "
        "usable boundary is 29 (N-1)"
    )


def test_stage_exits_nonzero_and_writes_nothing(tmp_path):
    """A stage started with bad params exits 2 before any work and leaves no output."""
    raw = defaults()
    raw["layers"] = [27, 2]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, str(REPO / "stages/prompts.py"), "out", "m.json"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "'layers' = [27, 2]: [27, 2] is not ascending" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def test_layer_n_refused_at_extracts_start_with_exit_2(tmp_path):
    """The first stage that reads `layers` and knows N (extract; target does not read `layers`) refuses h[N]
    with exit 2 before any work: no generation, no scratch, no features, no metrics."""
    from eaglepipe.target.tiny import build

    raw = defaults()
    raw["target"]["source"] = str(build("llama", tmp_path / "src"))  # N = 6
    raw["layers"] = [2, 3, 6]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, str(REPO / "stages/target.py"), "data/target", "target.json"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr  # the target stage does not read `layers` (dvc.yaml: params [target])
    (tmp_path / "train.jsonl").write_text(
        '{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}\n')
    r = subprocess.run([sys.executable, str(REPO / "stages/extract.py"), "data/target", "train.jsonl",
                        "data/features", "extract.json"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert ("error: params.yaml: 'layers' = [2, 3, 6]: h[6] is the last layer's output (N = 6), which extract "
            "captures anyway as the teacher's input (final norm -> lm_head), so it cannot also be an aux layer; "
            "the largest usable boundary is 5 (N-1)") in r.stderr
    assert "Traceback" not in r.stderr and "duplicates" not in r.stderr
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["target"]  # no .scratch, no features
    assert not (tmp_path / "extract.json").exists()
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert "layers" not in dvc["target"]["params"] and "layers" in dvc["extract"]["params"]
