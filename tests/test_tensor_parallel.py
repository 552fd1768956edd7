"""Tensor parallelism through the engines: vLLM and SGLang at TP 2 on CPU (one core group per rank) capture the
states the hf engine computes whole, for the same boundaries translated by the convention.

Each TP 2 start costs 40-90 s on 2 cores; the ids asked for are the convention's, so a rank that shifted a
layer would show as a cosine far below 1.
"""

from __future__ import annotations

import os

import pytest
import torch

from eaglepipe.contract import convention
from eaglepipe.engines import get_engine
from eaglepipe.engines.base import cpu_groups
from eaglepipe.errors import ParamsError
from eaglepipe.target.info import materialize_target
from eaglepipe.target.tiny import build

pytestmark = pytest.mark.slow
BOUNDARIES = [1, 3, 5]  # of N = 6: below N, so both engines can capture each
SEQUENCES = [[1, 5, 9, 13, 20, 30, 40, 50], [1, 7, 8, 9, 10]]
needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP 2 on CPU needs 2 cores")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    info = materialize_target(str(build("llama", root / "src")), root / "target")
    return root / "target", info


@pytest.fixture(scope="module")
def whole(target):
    with get_engine("hf", target[0]) as hf:
        return hf.capture(SEQUENCES, BOUNDARIES)


def _min_cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return min(torch.nn.functional.cosine_similarity(x.flatten(1), y.flatten(1), dim=-1).min().item()
               for x, y in zip(a, b))


@needs_two_cores
@pytest.mark.parametrize("engine", [pytest.param("vllm", marks=pytest.mark.vllm),
                                    pytest.param("sglang", marks=pytest.mark.sglang)])
def test_tp2_capture_equals_the_whole_target(engine, target, whole, tmp_path):
    pytest.importorskip(engine)
    target_dir, info = target
    ids = convention.engine_ids(engine, info.family, BOUNDARIES, info.n_layers)
    with get_engine(engine, target_dir, tensor_parallel_size=2, work_dir=tmp_path) as e:
        got = e.capture(SEQUENCES, ids)
    assert [g.shape for g in got] == [w.shape for w in whole]
    assert _min_cosine(got, whole) > 0.99999


def test_core_groups_give_each_rank_its_own_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2, 3})
    assert (cpu_groups(1), cpu_groups(2), cpu_groups(4)) == ("0-3", "0-1|2-3", "0|1|2|3")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 2})
    assert cpu_groups(1) == "0,2"
    with pytest.raises(ParamsError, match="tensor_parallel_size 3 on a CPU needs a core per rank"):
        cpu_groups(3)


def test_the_hf_engine_refuses_tensor_parallelism(target, tmp_path):
    """The hf engine shards a target (transformers' tp_plan="auto") only as one of that many torchrun ranks, which
    the extract stage launches (tests/test_distributed_extract.py runs it); alone it refuses. A family transformers
    has no plan for, or whose heads or vocabulary do not divide, is refused naming the file that decides it."""
    from transformers import GPT2Config, LlamaConfig

    from eaglepipe.engines.hf import check_tensor_parallel

    with pytest.raises(ParamsError, match="runs as that many torchrun ranks .* this world has 1"):
        get_engine("hf", target[0], tensor_parallel_size=2)
    GPT2Config(n_layer=2, n_embd=32, n_head=4).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ParamsError, match=r"no tensor-parallel plan for model_type 'gpt2' \(GPT2Config.base_model_tp_"
                       r"plan is empty in transformers/models/gpt2/configuration_gpt2.py\)"):
        check_tensor_parallel(tmp_path / "gpt2", 2)
    LlamaConfig(num_attention_heads=4, num_key_value_heads=2, vocab_size=100).save_pretrained(tmp_path / "llama")
    check_tensor_parallel(tmp_path / "llama", 2)
    with pytest.raises(ParamsError, match=r"\{'num_key_value_heads': 2\} do not divide by 4"):
        check_tensor_parallel(tmp_path / "llama", 4)


@needs_two_cores
@pytest.mark.vllm
def test_dvc_repro_at_tp2_on_vllm_serves_what_the_reference_decoder_accepts(tmp_path):
    """The whole pipeline on a tiny target with vLLM at TP 2 in extract, validate_offsets and serve_eval: served τ
    equal to the reference decoder's. (SGLang's capture at TP 2 is test_tp2_capture_equals_the_whole_target's, its
    gate test_sglang.py's; vLLM at TP 1 serving the reference decoder's τ, test_vllm_rope.py's.)"""
    import json

    import yaml
    from test_pipeline import copy_repo, dvc

    from eaglepipe.target.tiny import tiny_conversations

    pytest.importorskip("vllm")
    cwd = copy_repo(tmp_path / "repo")
    build("llama", cwd / "my_model", initializer_range=0.3)  # peaked next-token distributions: learnable answers
    (cwd / "convs.jsonl").write_text("".join(json.dumps(c) + "\n" for c in tiny_conversations(12)))
    params = yaml.safe_load((cwd / "params.yaml").read_text())
    params.update(layers=BOUNDARIES, framework="vllm", tensor_parallel_size=2)
    params["target"]["source"] = "my_model"
    params["prompts"].update({"source": "convs.jsonl", "train": 10, "eval": 2, "mtbench": False})
    # regenerated by vLLM at TP 2 too: the draft learns the target's own (repetitive, random-weight) answers
    params["extract"].update({"engine": "vllm", "regenerate": True, "max_new_tokens": 24, "max_length": 64})
    params["train"].update({"epochs": 10, "draft_vocab_size": 64, "draft_norms": []})  # the plain draft learns
    # this tiny target in 10 epochs (with the default norms it accepted nothing: τ 1.000)
    params["serve"].update({"prompts": 2, "max_new_tokens": 24})
    (cwd / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    r = dvc(cwd, "repro")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    offsets = json.loads((cwd / "metrics/offsets.json").read_text())
    assert offsets["verdict"] == "ok", offsets
    manifest = json.loads((cwd / "data/features/manifest.json").read_text())
    assert manifest["engine"] == "vllm" and manifest["tensor_parallel_size"] == 2
    served = json.loads((cwd / "metrics/serve_eval.json").read_text())
    assert served["vllm"]["tau"] == served["reference"]["tau"] > 1.05, served
    assert served["vllm"]["acc"] == served["reference"]["acc"]
    assert served["vllm"]["outputs_equal"]
