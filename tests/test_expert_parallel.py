"""Expert parallelism (params ``expert_parallel``): an MoE target's experts split over the tensor-parallel ranks
in vLLM (``enable_expert_parallel``) and SGLang (``ep_size`` = ``tp_size``), refused before any work where it
cannot run: at TP 1, in the hf engine, on a dense target, and on a CPU, where neither engine's MoE kernel
honours the expert split (:func:`eaglepipe.engine_table.expert_parallel_refusal` names the engine files).

The parity test runs where an engine offers expert parallelism (two CUDA GPUs) and skips elsewhere with the
engine's reason; the CPU tests start each engine once with the split forced past eaglepipe's refusal and
show that it fails as the reason says, so a release that fixes it turns them red and the refusal can go.
Each TP 2 start costs 30-110 s on 2 cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from eaglepipe.contract import convention
from eaglepipe.engine_table import expert_parallel_refusal
from eaglepipe.engines import get_engine
from eaglepipe.errors import ParamsError
from eaglepipe.params import parse_params
from eaglepipe.target.info import (
    materialize_target,
    num_experts,
    require_expert_parallel,
)
from eaglepipe.target.tiny import build

REPO = Path(__file__).resolve().parents[1]
BOUNDARIES = [1, 3, 5]  # of N = 6
SEQUENCES = [[1, 5, 9, 13, 20, 30, 40, 50], [1, 7, 8, 9, 10]]
CUDA = torch.cuda.is_available()
two_ranks = pytest.mark.skipif(torch.cuda.device_count() < 2 if CUDA else len(os.sched_getaffinity(0)) < 2,
                               reason="TP 2 needs 2 GPUs (on a CPU: 2 cores)")
ENGINES = [pytest.param("vllm", marks=pytest.mark.vllm), pytest.param("sglang", marks=pytest.mark.sglang)]
QWEN3_MOE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 99, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32}


@pytest.fixture(scope="module")
def moe_target(tmp_path_factory):
    """The tiny random qwen3_moe (4 experts, top-2, N = 6) as a target folder, and its TargetInfo."""
    root = tmp_path_factory.mktemp("ep")
    info = materialize_target(str(build("qwen3_moe", root / "src")), root / "target")
    return root / "target", info


def _min_cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return min(torch.nn.functional.cosine_similarity(x.flatten(1), y.flatten(1), dim=-1).min().item()
               for x, y in zip(a, b))


# ------------------------------------------------------------------ params and the target stage


def _params(**top) -> dict:
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw.update(top)
    return raw


def test_params_refuse_expert_parallel_at_one_rank_and_in_the_hf_engine():
    with pytest.raises(ParamsError, match="tensor_parallel_size is 1 .*set tensor_parallel_size ≥ 2 or "
                                          "expert_parallel: false"):
        parse_params(_params(expert_parallel=True, framework="vllm"))
    raw = _params(expert_parallel=True, tensor_parallel_size=2, framework="hf")
    raw["extract"]["engine"] = "vllm"
    with pytest.raises(ParamsError, match="expert_parallel splits the experts in vllm or sglang, but framework: hf "
                                          "runs the hf engine, which has no expert parallelism"):
        parse_params(raw)
    raw["framework"] = "sglang"
    assert parse_params(raw).expert_parallel


def test_experts_are_counted_as_vllm_counts_them():
    assert num_experts(transformers.Qwen3MoeConfig(**QWEN3_MOE)) == 4
    assert num_experts(transformers.DeepseekV3Config(n_routed_experts=8)) == 8
    assert num_experts(transformers.GptOssConfig(num_local_experts=2)) == 2
    assert num_experts(transformers.LlamaConfig()) == 0


def test_a_dense_target_and_uneven_experts_for_sglang_are_refused_naming_what_to_change():
    uses = {"vllm": ["extract.engine: vllm"], "sglang": ["framework: sglang"]}
    with pytest.raises(ParamsError, match="'my_llama' \\(model_type 'llama'\\) is a dense model with no experts"
                                          ".*set expert_parallel: false"):
        require_expert_parallel(transformers.LlamaConfig(), "my_llama", 2, uses, cuda=True)
    moe = transformers.Qwen3MoeConfig(**QWEN3_MOE)
    require_expert_parallel(moe, "moe", 2, uses, cuda=True)
    with pytest.raises(ParamsError, match="4 experts .* tensor_parallel_size 3 ranks, which SGLang needs to divide "
                                          "them evenly .*use vllm in place of sglang \\(framework: sglang\\)"):
        require_expert_parallel(moe, "moe", 3, uses, cuda=True)
    require_expert_parallel(moe, "moe", 3, {"vllm": ["framework: vllm"]}, cuda=True)  # vLLM splits unevenly


def test_on_a_cpu_each_engine_is_refused_naming_its_file():
    moe = transformers.Qwen3MoeConfig(**QWEN3_MOE)
    with pytest.raises(ParamsError) as e:
        require_expert_parallel(moe, "moe", 2, {"vllm": ["extract.engine: vllm"], "sglang": ["framework: sglang"]},
                                cuda=False)
    msg = str(e.value)
    assert msg.startswith("expert_parallel: true cannot run on this machine's CPU: extract.engine: vllm: vLLM")
    assert "vllm/model_executor/layers/fused_moe/experts/cpu_moe.py" in msg
    assert "framework: sglang: SGLang" in msg and "sglang/srt/layers/moe/fused_moe_native.py" in msg
    assert msg.endswith("Set expert_parallel: false (tensor_parallel_size alone shards the experts' weights), or "
                        "run on CUDA GPUs")
    assert expert_parallel_refusal("vllm", cuda=True) is None and expert_parallel_refusal("sglang", cuda=True) is None
    assert "one device" in expert_parallel_refusal("hf", cuda=True)


@pytest.mark.skipif(CUDA, reason="the CPU refusal")
def test_the_target_stage_refuses_expert_parallel_before_writing_anything(tmp_path):
    src = build("llama", tmp_path / "src")
    raw = _params(expert_parallel=True, tensor_parallel_size=2, framework="vllm")
    raw["target"]["source"] = str(src)
    raw["extract"]["engine"] = "vllm"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, str(REPO / "stages/target.py"), "out", "target.json", "unq"], cwd=tmp_path,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2 and not (tmp_path / "out").exists(), r.stderr[-2000:]
    assert "expert_parallel: true cannot run on this machine's CPU: extract.engine: vllm, framework: vllm" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_engines_refuse_it_where_they_cannot_run_it(moe_target):
    with pytest.raises(ParamsError, match="needs engine vllm or sglang"):
        get_engine("hf", moe_target[0], expert_parallel=True)
    if CUDA:
        return
    for engine in ("vllm", "sglang"):
        with pytest.raises(ParamsError, match=f"expert_parallel: .*{engine}/"):
            get_engine(engine, moe_target[0], tensor_parallel_size=2, expert_parallel=True)


# ------------------------------------------------------------------ the real engines


@two_ranks
@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_expert_parallel_capture_equals_the_tp1_capture(engine, moe_target, tmp_path):
    """TP 2 with the experts split (each rank 2 of the 4) captures what the same engine captures at TP 1."""
    pytest.importorskip(engine)
    why = expert_parallel_refusal(engine, CUDA)
    if why:
        pytest.skip(why)
    target_dir, info = moe_target
    ids = convention.engine_ids(engine, info.family, BOUNDARIES, info.n_layers)
    with get_engine(engine, target_dir, work_dir=tmp_path / "tp1") as e:
        whole = e.capture(SEQUENCES, ids)
    with get_engine(engine, target_dir, tensor_parallel_size=2, expert_parallel=True, work_dir=tmp_path / "ep") as e:
        got = e.capture(SEQUENCES, ids)
    assert [g.shape for g in got] == [w.shape for w in whole]
    assert _min_cosine(got, whole) > 0.9999


@two_ranks
@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="the CPU kernels' failure that the refusal names")
@pytest.mark.parametrize("engine", ENGINES)
def test_on_a_cpu_the_engines_fail_with_the_experts_split_as_the_refusal_says(engine, moe_target, tmp_path):
    """The split forced past eaglepipe's refusal (the engine's own argument): the capture kills the engine."""
    pytest.importorskip(engine)
    target_dir, info = moe_target
    ids = convention.engine_ids(engine, info.family, BOUNDARIES, info.n_layers)
    if engine == "vllm":
        from vllm.v1.engine.exceptions import EngineDeadError as died

        forced = {"llm_kwargs": {"enable_expert_parallel": True}, "work_dir": tmp_path}
    else:
        from eaglepipe.engines.sglang_worker import SGLangError as died

        forced = {"engine_kwargs": {"ep_size": 2}}
    with get_engine(engine, target_dir, tensor_parallel_size=2, **forced) as e, pytest.raises(died):
        e.capture(SEQUENCES, ids)


def test_features_made_with_the_experts_split_are_keyed_apart():
    """A resumed extract never mixes shards made with and without the split; without it the key is unchanged."""
    from eaglepipe.data.extract import plan_key
    from eaglepipe.params import ExtractParams
    from eaglepipe.target.info import TargetInfo

    info = TargetInfo("s", "qwen3_moe", "qwen3_moe", 6, 64, 99, "float32", True, "abc", {"rope_type": "default"})
    p = ExtractParams(engine="vllm")
    tp2 = plan_key(info, BOUNDARIES, p, "vllm", "h", 0, 2)
    assert plan_key(info, BOUNDARIES, p, "vllm", "h", 0, 2, False) == tp2
    assert plan_key(info, BOUNDARIES, p, "vllm", "h", 0, 2, True) != tp2
