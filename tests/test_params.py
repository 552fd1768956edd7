"""params.yaml validation: one clear message naming the key, the bad value and what is allowed."""

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
    check_layers_against_target([0, 15, 30], 30)
    with pytest.raises(ParamsError, match=r"\[31\] outside \[0, 30\]"):
        check_layers_against_target([2, 15, 31], 30)


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
