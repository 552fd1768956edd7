"""DVC tells the truth: a changed input reruns exactly what reads it, a bad key fails `dvc repro`, and a draft
that accepts nothing fails serve_eval. Tiny random targets, real DVC, real stage scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from conftest import tiny_tokenizer
from test_pipeline import copy_repo, dvc

REPO = Path(__file__).resolve().parents[1]
CONVS = [("Hi! Who are you?", "I am a helpful assistant."), ("Name a color.", "Blue."), ("Say hi.", "Hi!")]


def save_tiny_target(folder: Path, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=99, max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)


def write_convs(path: Path, convs) -> None:
    with open(path, "w") as f:
        for i, (q, a) in enumerate(convs):
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": q},
                                                            {"role": "assistant", "content": a}]}) + "\n")


@pytest.fixture()
def tiny_repo(tmp_path):
    cwd = copy_repo(tmp_path / "repo")
    save_tiny_target(cwd / "my_model", seed=0)
    write_convs(cwd / "convs.jsonl", CONVS)
    params = yaml.safe_load((cwd / "params.yaml").read_text())
    params["layers"] = [1, 2, 3]
    params["target"]["source"] = "my_model"
    params["prompts"].update({"source": "convs.jsonl", "train": 2, "eval": 1, "mtbench": False})
    (cwd / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return cwd


def _stage_ran(out: str, name: str) -> bool:
    assert f"'{name}'" in out, out
    return f"Stage '{name}' didn't change, skipping" not in out and f"Stage '{name}' is cached" not in out


def test_changed_source_contents_rerun_exactly_their_stage(tiny_repo):
    r = dvc(tiny_repo, "repro", "target", "prompts")
    assert r.returncode == 0, r.stdout + r.stderr
    first = json.loads((tiny_repo / "reports/target.json").read_text())["content_hash"]
    lock = yaml.safe_load((tiny_repo / "dvc.lock").read_text())["stages"]["target"]
    assert any(d["path"] == "my_model" and d["nfiles"] == 6 for d in lock["deps"]), lock["deps"]

    r = dvc(tiny_repo, "repro", "target", "prompts")  # nothing changed: both stay cached
    assert r.returncode == 0 and not _stage_ran(r.stdout, "target") and not _stage_ran(r.stdout, "prompts"), r.stdout

    save_tiny_target(tiny_repo / "my_model", seed=1)  # same path, new weights
    status = dvc(tiny_repo, "status", "target", "prompts").stdout  # DVC sees it without running anything
    assert "modified:           my_model" in status and "prompts" not in status, status
    r = dvc(tiny_repo, "repro", "target", "prompts")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _stage_ran(r.stdout, "target") and not _stage_ran(r.stdout, "prompts"), r.stdout
    second = json.loads((tiny_repo / "reports/target.json").read_text())["content_hash"]
    assert second != first

    write_convs(tiny_repo / "convs.jsonl", CONVS[:2] + [("Say bye.", "Bye!")])  # same file name, new contents
    r = dvc(tiny_repo, "repro", "target", "prompts")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not _stage_ran(r.stdout, "target") and _stage_ran(r.stdout, "prompts"), r.stdout


def test_unknown_top_level_key_fails_repro_with_the_key_named(tiny_repo):
    assert dvc(tiny_repo, "repro", "target").returncode == 0
    with open(tiny_repo / "params.yaml", "a") as f:
        f.write("framwork: sglang\n")
    r = dvc(tiny_repo, "repro", "target")
    assert r.returncode != 0
    assert "unknown key 'framwork'" in r.stdout + r.stderr


def _greedy_tokens(target: Path, prompts: list[list[int]], n: int) -> set[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seen = set()
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        seen |= set(out[0, len(ids):].tolist())
    return seen


def test_zero_acceptance_fails_serve_eval_and_names_the_causes(tmp_path, tiny_target):
    """A draft that always proposes a token the target never emits: τ = 1.000 exactly → exit 1, gate 'fail'."""
    from transformers import AutoTokenizer

    from eaglepipe.model.draft import DraftConfig, Eagle3Draft, save_draft
    from eaglepipe.serving.evaluate import eval_prompts

    layers, n_new = [1, 2, 3], 12
    write_convs(tmp_path / "eval.jsonl", CONVS[:2])
    from eaglepipe.data.prompts import read_jsonl
    prompts = eval_prompts(AutoTokenizer.from_pretrained(tiny_target), read_jsonl(tmp_path / "eval.jsonl"), 2)
    never = min(set(range(3, 99)) - _greedy_tokens(tiny_target, [p["input_ids"] for p in prompts], n_new))
    cfg = DraftConfig.from_target(json.loads((tiny_target / "config.json").read_text()), n_aux=3, draft_vocab_size=1)
    draft = Eagle3Draft(cfg)  # a one-token draft vocabulary: it can only ever propose `never`
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[never] = True
    draft.set_vocab(torch.tensor([never]), t2d)
    save_draft(draft, tmp_path / "drafter", extra={"layers": layers, "best_tau_sim": 2.4})
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params.update(layers=layers, framework="hf")
    params["serve"].update({"prompts": 2, "max_new_tokens": n_new})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = [tmp_path / "m.json", tmp_path / "r.json", tmp_path / "acc.csv"]
    r = subprocess.run([sys.executable, str(REPO / "stages/serve_eval.py"), str(tiny_target), str(tmp_path / "drafter"),
                        str(tmp_path / "export"), str(tmp_path / "eval.jsonl"), *map(str, out)],
                       cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "serve.min_tau = 1.05" in r.stderr and "layer ids" in r.stderr and "d2t" in r.stderr, r.stderr
    assert "(0 of " in r.stderr and "drafted tokens accepted over" in r.stderr, r.stderr
    metrics, report = json.loads(out[0].read_text()), json.loads(out[1].read_text())
    assert metrics["gate"] == "fail" and metrics["reference"]["tau"] == 1.0
    assert metrics["reference"]["acc"] == {"pos1": 0.0, "pos2": 0.0, "pos3": 0.0}
    assert report["gate"]["tau_sim"] == 2.4 and len(report["gate"]["failures"]) == 1
    assert any("below the trained draft's τ_sim 2.400" in f for f in report["gate"]["flags"])
    acc = pd.read_csv(out[2])
    assert list(acc["position"]) == ["reference pos1", "reference pos2", "reference pos3"]
    assert list(acc["acceptance"]) == [0.0, 0.0, 0.0]


def test_gate_says_when_the_draft_is_undertrained_not_miswired():
    from eaglepipe.serving.evaluate import acceptance_gate

    res = {"reference": {"tau": 1.0, "rounds": 14, "acceptance_per_pos": [0.0, 0.0, 0.0]},
           "vllm": {"tau": 1.0, "accepted_tokens": 0, "draft_tokens": 42}}
    failures, flags = acceptance_gate(res, tau_sim=1.0, min_tau=1.05, max_sim_gap=0.5)
    assert failures[0] == "reference: τ = 1.000 < serve.min_tau = 1.05 (0 of 42 drafted tokens accepted over 14 verify steps)"
    assert failures[1] == "vllm: τ = 1.000 < serve.min_tau = 1.05 (0 of 42 drafted tokens accepted)"
    assert "τ_sim is 1.000" in failures[2] and "undertrained" in failures[2] and flags == []
    failures, flags = acceptance_gate(res, tau_sim=2.0, min_tau=1.05, max_sim_gap=0.5)
    assert len(failures) == 2 and len(flags) == 2  # τ_sim 2.0: served 1.0 is a wiring problem, flagged per engine


def test_gate_blames_the_export_when_the_reference_accepts_and_the_engine_does_not():
    """Issue 42's run: an export with zeroed weights served by vLLM gave τ 1.000 while the reference decoder,
    running the trained draft (data/drafter) on the same prompts, gave τ 1.30. The failure says the export or
    vLLM's reading of it is at fault, not the training; the cases around it do not say so."""
    from eaglepipe.serving.evaluate import acceptance_gate

    failures, flags = acceptance_gate({"reference": {"tau": 1.30}, "vllm": {"tau": 1.0}}, tau_sim=None,
                                      min_tau=1.05, max_sim_gap=0.5)
    assert failures[0] == "vllm: τ = 1.000 < serve.min_tau = 1.05 (acceptance counts not reported)"
    assert failures[1].startswith("vllm: the reference decoder reaches τ 1.300 with the trained draft on the same "
                                  "prompts, vllm 1.000 with its export: the training is not at fault; the export "
                                  "or vllm's reading of it is")
    for cause in ("aux layer ids in the exported config.json", "d2t / t2d", "RoPE and architectures fields"):
        assert cause in failures[1]
    assert len(failures) == 2 and flags == []

    def blamed(reference, engine, min_tau=1.05):
        failures, flags = acceptance_gate({"reference": {"tau": reference}, "vllm": {"tau": engine}}, None,
                                          min_tau, 0.5)
        return [line for line in failures + flags if "the training is not at fault" in line]

    # the committed pipeline run (reports/serve_eval.json: reference and vLLM both τ 1.2041): nothing to say
    assert acceptance_gate({"reference": {"tau": 1.204057279236277}, "vllm": {"tau": 1.204057279236277}},
                           1.19506331132695, 1.05, 0.5) == ([], [])
    assert blamed(1.0, 1.0) == [] and blamed(1.08, 1.0) == []  # the draft accepts little anyway; within the margin
    assert blamed(1.15, 1.0, min_tau=1.2) == []  # the trained draft itself fails the gate: no export to blame
    assert blamed(1.8, 1.3) == []  # the engine accepts: a gap is the reference-distance flag's business
    smoke = acceptance_gate({"reference": {"tau": 1.30}, "vllm": {"tau": 1.0}}, None, 1.0, 0.5)
    assert smoke[0] == [] and len(smoke[1]) == 1 and "the training is not at fault" in smoke[1][0]  # near 1.0
