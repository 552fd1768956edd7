"""The target stage references a local HF folder: it never loads the weights, so any size of target passes it.

Run as a user runs it (the stage script in a folder with its own params.yaml), on tiny random targets.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglepipe.errors import ParamsError
from eaglepipe.target.info import read_info, weights_hash
from eaglepipe.target.tiny import build

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def _run_stage(cwd: Path, source: Path, **extract) -> subprocess.CompletedProcess:
    """stages/target.py in ``cwd`` with params.yaml's defaults but target.source (and extract.* overrides);
    the child's peak RSS is appended to ``cwd/rss`` by a wrapper that reads its own rusage at exit."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["target"]["source"] = str(source)
    params["extract"].update(extract)
    (cwd / "params.yaml").write_text(yaml.safe_dump(params))
    wrapper = ("import resource, runpy, sys; sys.argv = sys.argv[1:]\n"
               "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
               "finally:\n    open('rss', 'w').write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))\n")
    return subprocess.run([sys.executable, "-c", wrapper, str(REPO / "stages/target.py"), "out", "target.json", "unq"],
                          cwd=cwd, capture_output=True, text=True)


def _sparse_safetensors(path: Path, name: str, numel: int) -> None:
    """A valid safetensors file holding one float32 tensor of ``numel`` zeros, written sparse (no disk, no RAM)."""
    header = json.dumps({name: {"dtype": "F32", "shape": [numel], "data_offsets": [0, 4 * numel]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 4 * numel)


def test_a_folder_larger_than_memory_passes_without_loading_its_weights(tmp_path):
    src = build("llama", tmp_path / "src")
    _sparse_safetensors(src / "model-00002-of-00002.safetensors", "lm_extra.weight", 2 * GIB)  # 8 GiB shard
    (src / "original").mkdir()
    (src / "original" / "consolidated.00.pth").write_bytes(b"\0" * 1024)  # Llama repos ship one; never copied
    weights = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    r = _run_stage(tmp_path, src)
    assert r.returncode == 0, r.stderr[-2000:]
    peak = int((tmp_path / "rss").read_text())
    # the stage read the weights (the content hash), never held them: its peak is the tokenizer's and imports'
    assert weights > 8 * GIB and peak < weights / 4, (peak, weights)
    out = tmp_path / "out"
    linked = sorted(f.name for f in out.iterdir() if f.is_symlink())
    assert linked == ["model-00002-of-00002.safetensors", "model.safetensors"]
    assert all((out / n).resolve() == (src / n).resolve() for n in linked)
    assert not (out / "original").exists()
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {f.name for f in out.iterdir()}
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    report = json.loads((tmp_path / "target.json").read_text())
    assert (report["n_layers"], report["hidden_size"], report["family"]) == (6, 64, "llama")
    assert report["content_hash"] == weights_hash(src) == read_info(out).content_hash


def test_a_pre_quantized_folder_is_kept_as_shipped_and_refused_where_hf_would_capture_it(tmp_path):
    src = build("llama", tmp_path / "src")
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "compressed-tensors", "format": "int-quantized"}
    (src / "config.json").write_text(json.dumps(raw))
    (tmp_path / "vllm").mkdir()
    ok = _run_stage(tmp_path / "vllm", src, engine="vllm")
    assert ok.returncode == 0, ok.stderr[-2000:]
    saved = json.loads((tmp_path / "vllm" / "out" / "config.json").read_text())
    assert saved["quantization_config"]["quant_method"] == "compressed-tensors"  # the engines' kernels run it
    (tmp_path / "hf").mkdir()
    refused = _run_stage(tmp_path / "hf", src, engine="hf")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "'compressed-tensors'-quantized" in refused.stderr and "extract.engine: hf" in refused.stderr
    assert "set extract.engine to vllm or sglang" in refused.stderr


def test_the_hf_engine_refuses_a_quantized_target_before_loading_it(tmp_path):
    from eaglepipe.engines.hf import HFEngine

    src = build("llama", tmp_path / "src")
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8"}
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ParamsError, match="'fp8'-quantized weights"):
        HFEngine(src)


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_editing_a_linked_weight_file_changes_the_content_hash(tmp_path):
    src = build("llama", tmp_path / "src")
    assert _run_stage(tmp_path, src).returncode == 0
    before = read_info(tmp_path / "out").content_hash
    with open(src / "model.safetensors", "r+b") as f:  # one weight byte, through the user's own folder
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert read_info(tmp_path / "out").content_hash == before  # what the stage recorded, until it runs again
    assert _run_stage(tmp_path, src).returncode == 0  # what dvc repro does: the source folder is its dependency
    assert read_info(tmp_path / "out").content_hash == weights_hash(src) != before


def test_readers_take_the_recorded_hash_without_reading_the_weights(tmp_path, monkeypatch):
    """Every extraction rank reads the target's hash: the target stage's record, not a second pass over the
    weights (a terabyte for the largest targets)."""
    import eaglepipe.target.info as info_mod

    src = build("llama", tmp_path / "src")
    assert _run_stage(tmp_path, src).returncode == 0
    want = weights_hash(src)
    assert (tmp_path / "out" / info_mod.HASH_FILE).read_text().strip() == want

    def no_hashing(folder):
        raise AssertionError(f"hashed {folder} again")

    monkeypatch.setattr(info_mod, "weights_hash", no_hashing)
    assert read_info(tmp_path / "out").content_hash == want
    with pytest.raises(AssertionError, match="hashed"):  # a folder the stage did not write is still hashed
        read_info(src)


def test_a_layout_that_cannot_fit_is_refused_naming_the_tensor_parallel_size_that_would():
    from eaglepipe.target.info import GIB, check_fits

    check_fits(60 * GIB, 1, 80 * GIB, 1)  # 60 GiB of weights on one 80 GiB GPU: fits (75 %)
    with pytest.raises(ParamsError) as e:  # a 70B target in bf16 (141 GB) on one H100
        check_fits(131 * GIB, 1, 80 * GIB, 8)
    assert "131.0 GiB per GPU" in str(e.value) and "set tensor_parallel_size: 4 (32.8 GiB per GPU" in str(e.value)
    with pytest.raises(ParamsError) as e:  # ~1 T parameters in INT4 (Kimi-K2.5, ~594 GiB) on 8 x 80 GiB
        check_fits(594 * GIB, 8, 80 * GIB, 8)
    assert "set tensor_parallel_size: 16" in str(e.value) and "more than one host" in str(e.value)
    check_fits(594 * GIB, 8, 141 * GIB, 8)  # the same on 8 x H200: 74 GiB each


def test_a_quantized_folder_is_refused_before_anything_is_written(tmp_path):
    src = build("llama", tmp_path / "src")
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8"}
    (src / "config.json").write_text(json.dumps(raw))
    r = _run_stage(tmp_path, src, engine="hf")
    assert r.returncode == 2 and not (tmp_path / "out").exists(), r.stderr[-2000:]
