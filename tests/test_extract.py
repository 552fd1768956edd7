"""extract on the tiny target: stored features equal an independent capture; a killed run resumes exactly."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eaglepipe.data.features import FeatureSet, token_hash
from eaglepipe.data.prompts import write_jsonl
from eaglepipe.target.tiny import tiny_conversations

REPO = Path(__file__).resolve().parents[1]


conversations = tiny_conversations  # shared with tests/test_online.py and the benchmarks


def project(tmp: Path, tiny_target: Path, n: int, **extract) -> Path:
    """A working folder with params.yaml (tiny target: N = 4, layers [1, 2, 3]) and prompts/train.jsonl."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["layers"] = [1, 2, 3]
    params["extract"].update({"engine": "hf", "regenerate": True, "max_new_tokens": 24, "batch_size": 2,
                              "shard_size": 1, "dtype": "float32", **extract})
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp / "prompts").mkdir(exist_ok=True)
    write_jsonl(tmp / "prompts" / "train.jsonl", conversations(n))
    return tmp


def run_extract(cwd: Path, tiny_target: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "stages/extract.py"), str(tiny_target), "prompts/train.jsonl", "features", "extract.json"],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw,
    )


def test_stored_features_equal_independent_capture(tmp_path, tiny_target):
    from transformers import AutoModelForCausalLM

    cwd = project(tmp_path, tiny_target, 3, regenerate=False)
    out = run_extract(cwd, tiny_target).communicate()[0]
    fs = FeatureSet(cwd / "features")
    assert fs.layers == [1, 2, 3] and len(fs) == 3, out
    m = fs.manifest
    assert m["engine"] == "hf" and m["capture_ids"] == [1, 2, 3, 4] and m["target"]["n_layers"] == 4
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    for s in fs:
        with torch.no_grad():
            hs = model(s.input_ids[None], output_hidden_states=True).hidden_states
        for j, k in enumerate([1, 2, 3]):
            cos = torch.nn.functional.cosine_similarity(s.aux[:, j], hs[k][0], dim=-1)
            assert cos.min() >= 0.9999
        torch.testing.assert_close(model.model.norm(s.last), hs[4][0], rtol=1e-5, atol=1e-5)  # h[N] pre-norm
        assert m["samples"][[x["id"] for x in m["samples"]].index(s.id)]["token_hash"] == token_hash(s.input_ids)
    metrics = json.loads((cwd / "extract.json").read_text())
    assert metrics["samples"] == 3 and metrics["tokens"] == m["totals"]["tokens"] > 0
    assert metrics["bytes_per_token"] > 4 * 32 * 4  # 3 aux + last, H = 32, float32, plus ids/mask


def test_killed_run_resumes_to_the_same_result(tmp_path, tiny_target):
    n = 10
    ref = project(tmp_path / "ref", tiny_target, n)
    assert run_extract(ref, tiny_target).wait() == 0
    cwd = project(tmp_path / "killed", tiny_target, n)
    scratch = cwd / ".scratch" / "features"
    proc = run_extract(cwd, tiny_target)
    deadline = time.time() + 120
    while time.time() < deadline and not any(scratch.glob("*/shard-00001.safetensors")):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = sorted(p.name for p in scratch.glob("*/shard-*.safetensors"))
    assert 2 <= len(done) < n, f"the kill came too late or too early: {done}"
    assert not (cwd / "features" / "manifest.json").exists()
    first = {p.name: p.stat().st_mtime_ns for p in scratch.glob("*/shard-*.safetensors")}
    out = run_extract(cwd, tiny_target).communicate()[0]
    assert f"resuming: {len(done)} of {n} shards" in out
    for name, mtime in first.items():  # finished shards were kept, not redone
        assert (cwd / "features" / name).stat().st_mtime_ns == mtime
    assert not scratch.exists() or not any(scratch.iterdir())
    a, b = json.loads((ref / "features/manifest.json").read_text()), json.loads((cwd / "features/manifest.json").read_text())
    assert a["samples"] == b["samples"] and a["run_key"] == b["run_key"]
    assert _sha256_tree(ref / "features") == _sha256_tree(cwd / "features")  # killed + resumed: the same bytes
    for shard in a["shards"]:
        ta, tb = load_file(ref / "features" / shard["file"]), load_file(cwd / "features" / shard["file"])
        for k in ta:
            torch.testing.assert_close(ta[k], tb[k], rtol=0, atol=0)


def test_corrupted_feature_is_refused(tmp_path, tiny_target):
    from eaglepipe.errors import CaptureMismatch

    cwd = project(tmp_path, tiny_target, 2, regenerate=False)
    assert run_extract(cwd, tiny_target).wait() == 0
    man = json.loads((cwd / "features/manifest.json").read_text())
    man["samples"][1]["token_hash"] = "0" * 16
    (cwd / "features/manifest.json").write_text(json.dumps(man))
    with pytest.raises(CaptureMismatch, match="c1"):
        list(FeatureSet(cwd / "features"))


def _sha256_tree(folder: Path) -> dict[str, str]:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_two_extracts_in_separate_processes_are_byte_identical(tmp_path, tiny_target):
    """Same inputs, two processes (different hash seeds): every shard and the manifest hash the same."""
    digests = []
    for name, seed in (("a", "1"), ("b", "2")):
        cwd = project(tmp_path / name, tiny_target, 4, shard_size=2, dtype="bfloat16")
        proc = run_extract(cwd, tiny_target, env={**os.environ, "PYTHONHASHSEED": seed})
        out = proc.communicate()[0]
        assert proc.returncode == 0, out
        digests.append(_sha256_tree(cwd / "features"))
    assert set(digests[0]) == {"manifest.json", "shard-00000.safetensors", "shard-00001.safetensors"}
    assert digests[0] == digests[1]
    with open(tmp_path / "a" / "features" / "shard-00000.safetensors", "rb") as f:  # metadata keys sorted
        head = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert list(head["__metadata__"]) == sorted(head["__metadata__"])


def test_workers_write_the_same_shards_as_one_process(tmp_path, tiny_target):
    """extract.workers: 2 spawns two processes (shards 0, 2 and 1, 3), each with its own engine; the manifest and
    every shard are the same bytes as one process's."""
    digests = []
    for name, workers in (("one", 1), ("two", 2)):
        cwd = project(tmp_path / name, tiny_target, 4, dtype="bfloat16", workers=workers)
        proc = run_extract(cwd, tiny_target)
        out = proc.communicate()[0]
        assert proc.returncode == 0, out
        assert ("extracting 4 shards in 2 worker processes" in out) == (workers == 2), out
        digests.append(_sha256_tree(cwd / "features"))
    assert len(digests[0]) == 5 and digests[0] == digests[1]  # manifest + 4 shards
    metrics = json.loads((tmp_path / "two" / "extract.json").read_text())
    assert metrics["samples"] == 4 and metrics["generate_seconds"] > 0 and metrics["capture_seconds"] > 0


@pytest.fixture
def poisoned_target(tiny_target, tmp_path) -> Path:
    """The tiny target with the embedding row of the character 'Z' set to +inf (a damaged checkpoint)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "poisoned"
    shutil.copytree(tiny_target, out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    z = AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("Z")
    with torch.no_grad():
        model.model.embed_tokens.weight[z] = float("inf")
    model.save_pretrained(out)
    return out


def test_non_finite_sample_is_quarantined(tmp_path, poisoned_target):
    """c1 holds a 'Z' whose embedding is inf: c1 is left out and counted; c0, c2 are stored and finite."""
    from transformers import AutoModelForCausalLM

    cwd = project(tmp_path, poisoned_target, 3, regenerate=False, shard_size=1)
    convs = conversations(3)
    convs[1]["messages"][1]["content"] += " Zed"
    write_jsonl(cwd / "prompts" / "train.jsonl", convs)
    proc = run_extract(cwd, poisoned_target)
    out = proc.communicate()[0]
    assert proc.returncode == 0, out
    fs = FeatureSet(cwd / "features")
    m = fs.manifest
    assert [s.id for s in fs] == ["c0", "c2"] and m["totals"]["samples"] == 2
    assert [s["file"] for s in m["shards"]] == ["shard-00000.safetensors", "shard-00002.safetensors"]
    # the expected count, computed independently: non-finite values of h[1..3] of c1 in the HF model
    from transformers import AutoTokenizer

    from eaglepipe.data.template import tokenize_conversation

    ids = tokenize_conversation(AutoTokenizer.from_pretrained(poisoned_target), convs[1]["messages"], 512).input_ids
    model = AutoModelForCausalLM.from_pretrained(poisoned_target, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
    want = int((~torch.isfinite(torch.stack([hs[k][0] for k in (1, 2, 3)]).to(torch.float32))).sum())
    assert want > 0
    assert m["quarantined"] == [{"id": "c1", "tensor": "aux", "non_finite": want, "shard": 1}]
    assert m["totals"]["quarantined"] == 1
    assert json.loads((cwd / "extract.json").read_text())["quarantined"] == 1
    for s in fs:
        assert torch.isfinite(s.aux).all() and torch.isfinite(s.last).all()


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_damaged_shard_is_named(tmp_path, tiny_target, damage):
    from eaglepipe.errors import FeatureStoreError

    cwd = project(tmp_path, tiny_target, 2, regenerate=False)
    assert run_extract(cwd, tiny_target).wait() == 0
    shard = cwd / "features" / "shard-00001.safetensors"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
        why = f"{len(data) // 2} bytes, manifest says {len(data)} bytes"
    else:  # same size, the header length field overwritten
        shard.write_bytes((10**12).to_bytes(8, "little") + data[8:])
        why = "is damaged"
    fs = FeatureSet(cwd / "features")
    with pytest.raises(FeatureStoreError, match="shard-00001.safetensors") as e:
        list(fs)
    assert why in str(e.value)
