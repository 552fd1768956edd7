"""What a new user meets, run as they run it (each stage script in a folder with its own params.yaml): a broken model
folder is refused by `target` before anything is written; a parallel layout the host cannot hold by `check_params`;
a missing input by the stage that reads it, naming the stage that writes it; a full disk during `extract` is one
line, keeps the finished shards, and the rerun resumes to the bytes of an uninterrupted run. Never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_extract import project

from eaglepipe.host import layout_refusal
from eaglepipe.params import parse_params
from eaglepipe.stage import WRITTEN_BY
from eaglepipe.target.tiny import build

REPO = Path(__file__).resolve().parents[1]


def _stage(cwd: Path, script: str, *args: str, env: dict | None = None, **params) -> subprocess.CompletedProcess:
    """stages/<script>.py in ``cwd`` with params.yaml's defaults updated by ``params`` ({section: {key: value}})."""
    p = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in params.items():
        p[section].update(values) if isinstance(values, dict) else p.__setitem__(section, values)
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "params.yaml").write_text(yaml.safe_dump(p))
    return subprocess.run([sys.executable, str(REPO / "stages" / f"{script}.py"), *args], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=600)


def _refused(r: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The one-line error of a refused stage: exit ``code``, every word in it, no traceback."""
    err = r.stderr
    assert r.returncode == code, (r.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    line = next(x for x in err.splitlines() if x.startswith("error: "))
    for w in words:
        assert w in line, (w, line)
    return line


def _sharded(folder: Path) -> Path:
    """A tiny random Llama saved in 3+ shards with its index (what `hf download` leaves for a large model)."""
    from transformers import AutoModelForCausalLM

    src = build("llama", folder.parent / "whole")
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(folder, max_shard_size="300KB")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, folder / f.name)
    assert len(list(folder.glob("model-*.safetensors"))) >= 3
    return folder


def _target(cwd: Path, source: Path, **target) -> subprocess.CompletedProcess:
    return _stage(cwd, "target", "out", "target.json", "unq", target={"source": str(source), **target},
                  extract={"engine": "hf"})


def test_a_shard_the_index_names_is_missing(tmp_path):
    src = _sharded(tmp_path / "src")
    second = sorted(src.glob("model-*.safetensors"))[1]
    second.unlink()
    line = _refused(_target(tmp_path, src), 2, f"model.safetensors.index.json names {second.name}", "missing",
                    "download")
    assert str(src) in line and not (tmp_path / "out").exists() and not (tmp_path / "target.json").exists()


def test_a_truncated_shard_and_a_dangling_link(tmp_path):
    src = _sharded(tmp_path / "src")
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])  # a download cut short
    _refused(_target(tmp_path / "a", src), 2, f"{shard} is truncated", f"the file has {len(data) - 100:,}")
    shard.unlink()
    shard.symlink_to(tmp_path / "gone.safetensors")  # a cache link whose blob was removed
    _refused(_target(tmp_path / "b", src), 2, f"{shard} is a link to a missing file")
    assert not (tmp_path / "a" / "out").exists() and not (tmp_path / "b" / "out").exists()


def test_weights_without_a_tensor_the_architecture_needs(tmp_path):
    from safetensors.torch import load_file, save_file

    src = build("llama", tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.3.mlp.down_proj.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    _refused(_target(tmp_path, src), 2, "lack 1 tensors", "LlamaConfig", "model.layers.3.mlp.down_proj.weight")
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_without_a_chat_template_is_refused_until_params_give_one(tmp_path):
    src = build("llama", tmp_path / "src")
    (src / "chat_template.jinja").unlink()
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    _refused(_target(tmp_path / "a", src), 2, "has no chat template", "target.chat_template")
    assert not (tmp_path / "a" / "out").exists()
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    r = _target(tmp_path / "b", src, chat_template=template)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "b" / "out" / "chat_template.jinja").read_text() == template
    assert json.loads((tmp_path / "b" / "target.json").read_text())["has_chat_template"] is True
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "b" / "out")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[user] hi\n"


def test_a_generation_config_with_an_eos_outside_the_vocabulary(tmp_path):
    src = build("llama", tmp_path / "src")
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 128001]}))
    _refused(_target(tmp_path, src), 2, "generation_config.json sets eos_token_id [2, 128001]", "99 tokens")


def _params(**kw):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for key, value in kw.items():
        section, _, name = key.partition("__")
        raw[section].update({name: value}) if name else raw.__setitem__(section, value)
    return parse_params(raw)


def test_layouts_a_host_cannot_hold_are_named_with_the_users_numbers():
    hf3 = _params(tensor_parallel_size=3, extract__engine="hf", extract__store="features", framework="vllm")
    assert layout_refusal(hf3, gpus=0, cores=2) == (
        "extract.engine: hf at tensor_parallel_size 3 runs 3 tensor-parallel ranks of one hf replica, one core each: "
        "3 cores, but this host has 2. Set tensor_parallel_size: 2.")
    assert layout_refusal(hf3, gpus=0, cores=4) is None
    v = _params(tensor_parallel_size=4, extract__engine="vllm", extract__nproc_per_node=2, framework="vllm")
    assert layout_refusal(v, gpus=8, cores=16) is None
    assert layout_refusal(v, gpus=4, cores=16) == (
        "extract.engine: vllm at tensor_parallel_size 4 with extract.nproc_per_node 2 runs 2 replicas × 4 "
        "tensor-parallel ranks, one GPU each: 8 GPUs, but this host has 4. Set tensor_parallel_size: 2 or "
        "extract.nproc_per_node: 1.")
    serve = _params(tensor_parallel_size=2, extract__engine="hf", extract__store="features", framework="sglang")
    assert layout_refusal(serve, gpus=1, cores=16) == (
        "extract.engine: hf at tensor_parallel_size 2 runs 2 tensor-parallel ranks of one hf replica, one GPU each: "
        "2 GPUs, but this host has 1. Set tensor_parallel_size: 1.")
    train = _params(train__nproc_per_node=4)
    assert "train.nproc_per_node 4" in layout_refusal(train, gpus=2, cores=16)


def test_check_params_refuses_more_tensor_parallel_ranks_than_this_host_has(tmp_path):
    cores = len(os.sched_getaffinity(0))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # a CPU host, whatever this one has
    r = _stage(tmp_path, "check_params", "ok.json", env=env, tensor_parallel_size=cores + 1,
               extract={"engine": "hf", "store": "features"})
    _refused(r, 2, f"tensor_parallel_size {cores + 1}", f"this host has {cores}", f"Set tensor_parallel_size: {cores}")
    assert not (tmp_path / "ok.json").exists()


def test_writer_of_is_dvc_yamls_outs():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    outs = {next(iter(o)) if isinstance(o, dict) else o: name for name, st in stages.items() for o in st.get("outs", [])}
    for path, stage in WRITTEN_BY.items():
        assert outs.get(path) == stage, path
    inputs = {d for st in stages.values() for d in st["deps"]} & set(outs)
    assert inputs <= set(WRITTEN_BY) | {"data/params_ok.json"}, inputs - set(WRITTEN_BY)


# stage → its argv; each path that a stage reads from the pipeline is made missing in turn (the others exist)
READS = {
    "extract": (["data/target", "data/prompts/train.jsonl", "data/features", "reports/extract.json"], [0, 1]),
    "validate_offsets": (["data/target", "data/features", "data/validated.json", "metrics/offsets.json",
                          "reports/offsets.json", "metrics/offsets_cosine.csv", "data/unquantized"], [0, 1, 6]),
    "train_drafter": (["data/features", "data/target", "data/drafter", "metrics/train.json", "reports/train.json",
                       "dvclive"], [0, 1]),
    "export": (["data/target", "data/drafter", "data/export"], [0, 1]),
    "serve_eval": (["data/target", "data/drafter", "data/export", "data/prompts/eval.jsonl", "metrics/serve_eval.json",
                    "reports/serve_eval.json", "metrics/serve_acceptance.csv"], [0, 1, 2, 3]),  # export: framework vllm
}


@pytest.mark.parametrize("stage,missing", [(s, i) for s, (_, reads) in READS.items() for i in reads])
def test_a_missing_input_names_the_stage_that_writes_it(tmp_path, stage, missing):
    argv, reads = READS[stage]
    for i in reads:
        if i != missing:
            path = tmp_path / argv[i]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch() if path.suffix else path.mkdir()
    writer = WRITTEN_BY["/".join(Path(argv[missing]).parts[:2])]
    _refused(_stage(tmp_path, stage, *argv), 1, f"stage `{stage}` reads {argv[missing]}, which does not exist",
             f"stage `{writer}` writes it: run `dvc repro {writer}`")


def _full_disk_run(cwd: Path, target: Path, size: str) -> subprocess.CompletedProcess | None:
    """extract in ``cwd`` with its scratch folder (where shards are written) on a tmpfs of ``size``, mounted in a
    mount namespace of its own (unshare); the scratch's contents copied out to ``cwd/kept`` after. None where this
    host allows no such mount."""
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=8k tmpfs {cwd}"],
                           capture_output=True)
    if probe.returncode != 0:
        return None
    (cwd / ".scratch").mkdir()
    (cwd / "kept").mkdir()
    script = (f"mount -t tmpfs -o size={size} tmpfs .scratch && {sys.executable} {REPO / 'stages/extract.py'} "
              f"{target} prompts/train.jsonl features extract.json; rc=$?; cp -a .scratch/. kept/; exit $rc")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_a_full_disk_during_extract_is_one_line_and_the_rerun_resumes_to_the_same_bytes(tmp_path, tiny_target):
    ref = project(tmp_path / "ref", tiny_target, 4, shard_size=1)
    assert subprocess.run([sys.executable, str(REPO / "stages/extract.py"), str(tiny_target), "prompts/train.jsonl",
                           "features", "extract.json"], cwd=ref, capture_output=True).returncode == 0
    sizes = [f.stat().st_size for f in sorted((ref / "features").glob("shard-*"))]
    cwd = project(tmp_path / "full", tiny_target, 4, shard_size=1)
    pages = sum(-(-s // 4096) for s in sizes[:2])  # room for shards 0 and 1, not for shard 2
    r = _full_disk_run(cwd, tiny_target, f"{4 * (pages + 1)}k")
    if r is None:
        pytest.skip("needs a small file system: this host allows no tmpfs mount in a user namespace (unshare -rm)")
    line = _refused(r, 1, "no space left on the device writing .scratch/features/", "shard-00002.safetensors",
                    f"{sizes[2] / 1024:,.1f} KiB needed", "free on the file system", "Kept for the rerun: 2 finished")
    assert "rerun" in line
    kept = sorted(p.name for p in (cwd / "kept").rglob("shard-*"))
    assert kept == ["shard-00000.safetensors", "shard-00001.safetensors"]  # the failed shard's .tmp removed
    shutil.copytree(cwd / "kept", cwd / ".scratch", dirs_exist_ok=True)  # the space freed: a rerun resumes
    again = subprocess.run([sys.executable, str(REPO / "stages/extract.py"), str(tiny_target), "prompts/train.jsonl",
                            "features", "extract.json"], cwd=cwd, capture_output=True, text=True)
    assert again.returncode == 0 and "resuming: 2 of 4 shards already written" in again.stderr, again.stderr[-2000:]
    for f in sorted((ref / "features").iterdir()):
        assert (cwd / "features" / f.name).read_bytes() == f.read_bytes(), f.name
