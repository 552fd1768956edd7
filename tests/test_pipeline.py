"""`dvc repro` in a temporary copy of the repo, on the real SmolLM2 and a handful of short conversations."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from eaglepipe.data.features import FeatureSet
from eaglepipe.sources import link_bundled

REPO = Path(__file__).resolve().parents[1]
CONVS = [
    ("Hi! Who are you?", "I am a helpful assistant."),
    ("What is 2 + 2?", "2 + 2 equals 4."),
    ("Name a color.", "Blue."),
    ("Say hello in French.", "Bonjour!"),
    ("What is the capital of Italy?", "Rome is the capital of Italy."),
    ("Give me a fruit.", "An apple."),
]


def copy_repo(dst: Path) -> Path:
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dst / f)
    link_bundled(dst)  # as scripts/setup.sh does
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    subprocess.run(git + ["add", "-A"], cwd=dst, check=True)
    subprocess.run(git + ["commit", "-qm", "copy"], cwd=dst, check=True)
    return dst


def tiny_repo(dst: Path, target: Path, extract: dict) -> Path:
    """A copy of the repo whose params run a tiny ``target`` through vLLM on 10 tiny conversations (h[1..3], 2
    epochs, 2 served prompts of 16 tokens, τ ≥ 1 accepted); ``extract``: params over the extract defaults."""
    from eaglepipe.target.tiny import tiny_conversations

    cwd = copy_repo(dst)
    (cwd / "convs.jsonl").write_text("".join(json.dumps(c) + "\n" for c in tiny_conversations(10)))
    params = yaml.safe_load((cwd / "params.yaml").read_text())
    params.update(layers=[1, 2, 3], framework="vllm")
    params["target"]["source"] = str(target)
    params["prompts"].update({"source": "convs.jsonl", "train": 8, "eval": 2, "mtbench": False})
    params["extract"].update(extract)
    params["train"].update({"epochs": 2, "draft_vocab_size": 64})
    params["serve"].update({"prompts": 2, "max_new_tokens": 16, "min_tau": 1.0})  # 8 samples: τ may be 1
    (cwd / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return cwd


def dvc(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DVC_SITE_CACHE_DIR": str(cwd / ".dvc-site"), "DVC_NO_ANALYTICS": "1"}
    return subprocess.run(["dvc", *args], cwd=cwd, capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def repo(tmp_path_factory, smollm2_dir):
    cwd = copy_repo(tmp_path_factory.mktemp("repo"))
    with open(cwd / "convs.jsonl", "w") as f:
        for i, (q, a) in enumerate(CONVS):
            f.write(json.dumps({"id": f"t{i}", "messages": [{"role": "user", "content": q},
                                                            {"role": "assistant", "content": a}]}) + "\n")
    params = yaml.safe_load((cwd / "params.yaml").read_text())
    params["framework"] = "hf"
    params["target"]["source"] = str(smollm2_dir)
    params["prompts"].update({"source": "convs.jsonl", "train": 4, "eval": 2, "mtbench": False})
    params["extract"].update({"max_new_tokens": 12, "batch_size": 4, "dtype": "float32", "shard_size": 2})
    params["train"].update({"draft_vocab_size": 512, "epochs": 1, "batch_tokens": 256, "checkpoint_every": 5})
    params["serve"].update({"prompts": 2, "max_new_tokens": 8, "min_tau": 1.0})  # 4 samples, 1 epoch: τ may be 1
    (cwd / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "test params"], cwd=cwd,
                   check=True)
    return cwd


@pytest.mark.slow
def test_dvc_repro_extract_on_smollm2(repo, smollm2_dir):
    from transformers import AutoModelForCausalLM

    r = dvc(repo, "repro", "extract")
    assert r.returncode == 0, r.stdout + r.stderr
    fs = FeatureSet(repo / "data/features")
    assert fs.layers == [2, 15, 27] and fs.n_layers == 30 and len(fs) == 4
    m = fs.manifest
    assert m["engine"] == "hf" and m["regenerate"]["max_new_tokens"] == 12 and m["capture_ids"] == [2, 15, 27, 30]
    metrics = json.loads((repo / "reports/extract.json").read_text())
    assert metrics["samples"] == 4 and metrics["tokens"] == m["totals"]["tokens"] and metrics["tokens_per_s"] > 0
    # one stored sample against an independent HF pass: every stored h[k], and h[N] pre-norm
    s = fs.take(1)[0]
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(s.input_ids[None], output_hidden_states=True).hidden_states
        for j, k in enumerate([2, 15, 27]):
            assert torch.nn.functional.cosine_similarity(s.aux[:, j], hs[k][0], dim=-1).min() >= 0.9999
        assert torch.nn.functional.cosine_similarity(model.model.norm(s.last), hs[30][0], dim=-1).min() >= 0.9999
    assert s.loss_mask.any() and not s.loss_mask[-1]
    assert dvc(repo, "status", "extract").stdout.strip().endswith("up to date.")


@pytest.mark.slow
def test_dvc_repro_to_the_end_then_layer_sweep_is_refused_cleanly(repo):
    r = dvc(repo, "repro")
    assert r.returncode == 0, r.stdout + r.stderr
    ev = json.loads((repo / "reports/serve_eval.json").read_text())
    assert ev["reference"]["outputs_equal"] and 1.0 <= ev["reference"]["tau"] <= 4.0
    cfg = json.loads((repo / "data/export/sglang/config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert json.loads((repo / "data/export/vllm/config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    # an out-of-range layer is refused before any work, naming the key
    r = dvc(repo, "exp", "run", "-S", "layers=[2,15,31]")
    assert r.returncode != 0 and "[31] outside [0, 29]" in r.stdout + r.stderr
