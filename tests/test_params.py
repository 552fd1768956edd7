"""params.yaml validation: one clear message naming the key, the bad value and what is allowed."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglepipe.errors import ParamsError
from eaglepipe.params import check_layers_against_target, load_params, parse_params
from eaglepipe.profiles import leaves, merged_params, override_value, profile_sets

REPO = Path(__file__).resolve().parents[1]


def defaults() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text())


def test_repo_params_are_valid():
    p = load_params(REPO / "params.yaml")
    assert p.layers == [2, 15, 27] and p.framework == "vllm" and p.extract.engine == "hf"
    assert p.validate_.search == 2


def test_gpu_profile_merges_into_valid_params():
    """profiles/gpu.yaml over params.yaml (as `dvc exp run $(eaglepipe profile profiles/gpu.yaml)` applies it):
    valid, and what issue 13 runs."""
    p = parse_params(merged_params(REPO / "profiles" / "gpu.yaml", params_path=REPO / "params.yaml"))
    assert (p.framework, p.extract.regenerate_engine, p.extract.store, p.extract.engine) == ("vllm", "vllm", "tokens", "hf")
    assert p.prompts.max_records == 0 and p.serve.prompts == 80 and p.serve.batch_sizes == [1, 8]


def test_topics_profile_merges_after_the_gpu_profile():
    """profiles/synthetic_topics.yaml after profiles/gpu.yaml: only prompts.synthetic_topics moves."""
    profiles = REPO / "profiles"
    base = parse_params(merged_params(profiles / "gpu.yaml", params_path=REPO / "params.yaml"))
    p = parse_params(merged_params(profiles / "gpu.yaml", profiles / "synthetic_topics.yaml",
                                   params_path=REPO / "params.yaml"))
    assert len(p.prompts.synthetic_topics) == 10 and base.prompts.synthetic_topics == []
    assert p.model_copy(update={"prompts": base.prompts}) == base
    assert p.prompts.model_copy(update={"synthetic_topics": []}) == base.prompts


def test_profile_sets_are_dvc_exp_run_arguments():
    """One `-S key.path=value` per value the profile sets, in its order, typed values written so that -S keeps
    their type: strings quoted, lists and booleans as YAML/JSON would write them."""
    sets = profile_sets(REPO / "profiles" / "gpu.yaml", params_path=REPO / "params.yaml")
    assert sets[0::2] == ["-S"] * (len(sets) // 2)
    assert sets[1:8:2] == ['framework="vllm"', "prompts.max_records=0", "prompts.drop_leading_assistant=true",
                           "prompts.train=16270"]
    assert "serve.batch_sizes=[1,8]" in sets and 'train.teacher_precision="tf32"' in sets
    assert [v for k, v in leaves({"a": {"b": [None, "x y", 1.5, False]}, "c": {}})] == [[None, "x y", 1.5, False], {}]
    assert override_value([None, "x y", 1.5, False, -3]) == '[null,"x y",1.5,false,-3]'
    for bad in ("a\\b", "${x}", "yes", "12:30"):  # escapes, interpolation, YAML 1.1's readings
        with pytest.raises(ParamsError, match="set it"):
            override_value(bad)


def test_profile_sets_round_trip_through_dvc(tmp_path):
    """DVC's own -S code (dvc.utils.hydra.apply_overrides, what `dvc exp run -S` calls) turns the arguments back
    into exactly params.yaml with the profiles over it: strings that read as other types, null, nested lists and
    a key params.yaml lacks (written with Hydra's +) included."""
    pytest.importorskip("dvc")
    from dvc.utils.hydra import apply_overrides

    profiles = [REPO / "profiles" / "gpu.yaml", REPO / "profiles" / "synthetic_topics.yaml"]
    odd = tmp_path / "odd.yaml"
    odd.write_text(yaml.safe_dump({"target": {"dtype": "bfloat16"}, "prompts": {"synthetic_topics": [
        "0", "null", "true", 'say "hi", τ=1 [x]: {y}', "it's", "", "#c", "a,b=c"]}, "extract": {"quantization": None},
        "serve": {"batch_sizes": [None, 2], "min_tau": 1.5}, "validate": {"reference": False}}))
    for ps in (profiles[:1], [*profiles, odd]):
        params = tmp_path / "params.yaml"
        params.write_text((REPO / "params.yaml").read_text())
        sets = profile_sets(*ps, params_path=params)
        apply_overrides(params, sets[1::2])
        assert yaml.safe_load(params.read_text()) == merged_params(*ps, params_path=REPO / "params.yaml")
    raw = defaults()
    del raw["train"]["seed"]  # a key params.yaml lacks
    params.write_text(yaml.safe_dump(raw))
    (tmp_path / "seed.yaml").write_text("train:\n  seed: 3\n")
    sets = profile_sets(tmp_path / "seed.yaml", params_path=params)
    assert sets == ["-S", "+train.seed=3"]
    apply_overrides(params, sets[1::2])
    assert yaml.safe_load(params.read_text())["train"]["seed"] == 3


def test_a_bad_profile_fails_before_dvc_runs_anything(tmp_path):
    """`eaglepipe profile` validates the merged params: a bad one names the key on stderr, exits 2, and prints
    only an argument `dvc exp run` refuses, so `dvc exp run $(eaglepipe profile bad.yaml)` stops at once."""
    from eaglepipe.cli import PROFILE_FAILED

    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: 0\nlayerz: [1]\n")
    with pytest.raises(ParamsError, match="'train.epochs' = 0") as e:
        profile_sets(bad, params_path=REPO / "params.yaml")
    assert "unknown key 'layerz'" in str(e.value) and str(bad) in str(e.value)
    r = subprocess.run([sys.executable, "-m", "eaglepipe.cli", "profile", str(bad)], cwd=REPO, capture_output=True,
                       text=True)
    assert (r.returncode, r.stdout) == (2, PROFILE_FAILED + "\n") and "'train.epochs' = 0" in r.stderr
    r = subprocess.run([sys.executable, "-m", "eaglepipe.cli", "profile", "profiles/gpu.yaml"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == profile_sets(REPO / "profiles" / "gpu.yaml",
                                                                   params_path=REPO / "params.yaml")


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
    ({"train": {"draft_norms": ["norm_before"]}}, "'train.draft_norms.0' = 'norm_before'"),
    ({"train": {"draft_norms": ["norm_before_fc", "fc_norm"]}}, "norm_before_fc or fc_norm, not both"),
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


TP2 = {"tensor_parallel_size": 2}


@pytest.mark.parametrize("patch,expect", [
    ({"framework": "hf"}, "hf engine as framework: validate_offsets and serve_eval run hf on one device"),
    ({"extract": {"engine": "vllm", "regenerate_engine": "hf"}}, "so both must be hf (regenerate_engine null)"),
    ({"extract": {"regenerate_engine": "vllm"}}, "so both must be hf (regenerate_engine null), or neither"),
    ({"extract": {"store": "tokens"}}, "extract.store tokens makes train_drafter capture online with hf"),
    ({"extract": {"nproc_per_node": 2}}, "initialize_distributed_mesh: no data-parallel dimension"),
    ({"extract": {"workers": 2}}, "extract.nproc_per_node 1, extract.workers 2; one hf replica takes 2 torchrun"),
])
def test_hf_tensor_parallelism_is_refused_where_it_is_not_built(patch, expect):
    """hf at tensor_parallel_size > 1 is extraction's (its stage's own torchrun ranks), one replica, features
    stored; everything else is refused at params time, naming what to change."""
    raw = {**defaults(), **TP2}
    assert parse_params(raw).extract.engine == "hf"  # the defaults at TP 2: hf extracts, vllm gates and serves
    for k, v in patch.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) else v
    with pytest.raises(ParamsError, match="tensor_parallel_size 2 with the hf engine") as e:
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
    r = subprocess.run([sys.executable, str(REPO / "stages/target.py"), "data/target", "target.json",
                        "data/unquantized"], cwd=tmp_path, capture_output=True, text=True)
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
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["target", "unquantized"]  # no features
    assert not (tmp_path / "extract.json").exists()
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert "layers" not in dvc["target"]["params"] and "layers" in dvc["extract"]["params"]


def test_a_norm_the_serving_engine_does_not_read_is_refused_at_check_params(tmp_path):
    """SGLang ignores norm_before_residual: check_params exits 2 naming it, before any work; vLLM reads it."""
    raw = defaults()
    raw["framework"], raw["train"] = "sglang", {**raw["train"], "draft_norms": ["norm_before_residual"]}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, str(REPO / "stages/check_params.py"), str(tmp_path / "ok.json")],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2 and not (tmp_path / "ok.json").exists(), r.stdout + r.stderr
    assert "train.draft_norms ['norm_before_residual'] with framework sglang: sglang 0.5.23 does not read " \
           "norm_before_residual" in r.stderr
    raw["framework"] = "vllm"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, str(REPO / "stages/check_params.py"), str(tmp_path / "ok.json")],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
