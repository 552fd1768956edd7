"""The GPU window's keep path, run here on CPU with the real scripts (lab/gpu_engines/): what one window
finished (draft-data's tokens store, a trained draft) comes back in ≤ 15 MiB parts with `suite.sh watch`,
becomes a carry folder with `keep_drafter.sh`, and a later window stashes and installs it byte for byte beside
the wheels' carries. Four H200 windows in a row lost their machine mid-run, so this is what a run resumes from.
(The stages that follow a restore, gpu_run.sh, need the H200 and its carried engines; not run here.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ("suite.sh", "device.sh", "keep_drafter.sh")

pytestmark = pytest.mark.skipif(shutil.which("split") is None or shutil.which("sha256sum") is None,
                                reason="needs coreutils' split and sha256sum (the device machine's tools)")


def _sh(repo: Path, env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], cwd=repo, env={**os.environ, **env}, capture_output=True, text=True,
                          check=check, timeout=120)


@pytest.fixture
def window(tmp_path):
    """A repo copy holding the three scripts, a stand-in data/ after draft-data (a 70 MB shard: five parts), a
    finished pipeline's results folder, a stand-in wheels carry c01 and its MANIFEST; the env pointing
    suite.sh's and device.sh's /tmp folders into tmp_path."""
    repo = tmp_path / "repo"
    (repo / "lab/gpu_engines").mkdir(parents=True)
    for s in SCRIPTS:
        shutil.copy(REPO / "lab/gpu_engines" / s, repo / "lab/gpu_engines" / s)
    feats = repo / "data/features"
    feats.mkdir(parents=True)
    (feats / "shard-00000.safetensors").write_bytes(os.urandom(70_000_000))
    (feats / "manifest.json").write_text('{"store": "tokens"}')
    (repo / "data/validated.json").write_text('{"ok": true}')
    (repo / "data/drafter").mkdir()
    (repo / "data/drafter/model.safetensors").write_bytes(os.urandom(1000))
    res = tmp_path / "res"
    res.mkdir()
    (res / "steps.txt").write_text("start\ndraft-data rc=0\n")
    (res / "DONE").write_text("done\n")
    (res / "draft_data.log").write_text("=== extract: exit 0\n")
    carry = repo / ".gpu/carry"
    (carry / "c01").mkdir(parents=True)
    (carry / "c01/vllm.tar.part00").write_bytes(b"wheels")
    sha = subprocess.run(["sha256sum", "vllm.tar.part00"], cwd=carry / "c01", capture_output=True, text=True,
                         check=True).stdout
    manifest = f"{'0' * 64}  vllm.tar\n{sha}"
    (carry / "MANIFEST.sha256").write_text(manifest)
    (carry / "c01/MANIFEST.sha256").write_text(manifest)
    env = {"REPO_ROOT": str(repo), "KEEP": str(tmp_path / "keep"), "RES": str(res), "DEVICE_ENG": str(tmp_path / "eng"),
           "KEEP_XZ": "-0"}  # the fastest xz level: random bytes do not compress at any
    return repo, env, tmp_path


def _watch(repo: Path, env: dict, out: Path) -> list[str]:
    _sh(repo, {**env, "OUT": str(out)}, "lab/gpu_engines/suite.sh", "watch", "600", check=False)  # rc ≠ 0:
    return sorted(p.name for p in out.iterdir())  # no nvidia-smi here; 600 s: a wait would time the call out


def test_kept_data_comes_back_once_and_installs_byte_for_byte(window):
    repo, env, tmp = window
    suite = "lab/gpu_engines/suite.sh"
    _sh(repo, {**env, "OUT": str(tmp / "out0")}, suite, "data-keep")
    # the device returns ≤ 8 files, 64 MiB a call: ≤ 3 parts a watch, at once while some are left, each once
    parts = [f"draftdata.tar.xz.part0{i}" for i in range(5)]
    assert _watch(repo, env, tmp / "out1") == ["draftdata.sha256", *parts[:3], "res.tgz"]
    assert (tmp / "out1/draftdata.tar.xz.part00").stat().st_size == 15 * 2**20
    assert (tmp / "out1/draftdata.tar.xz.part00").read_bytes()[:6] == b"\xfd7zXZ\x00"  # xz's magic: compressed
    with tarfile.open(tmp / "out1/res.tgz") as t:
        assert "./steps.txt" in t.getnames()
    (tmp / "res/DONE").rename(tmp / "res/DONE.later")  # the pipeline still running: a watch would wait 600 s ...
    assert _watch(repo, env, tmp / "out2") == ["draftdata.sha256", *parts[3:], "res.tgz"]  # ... but parts are left
    (tmp / "res/DONE.later").rename(tmp / "res/DONE")
    assert _watch(repo, env, tmp / "out2b") == ["res.tgz"]

    _sh(repo, {**env, "OUT": str(tmp / "out0")}, suite, "draft-keep")  # then a trained draft, kept too
    _sh(repo, {**env, "OUT": str(tmp / "out3")}, suite, "watch", "5", check=False)
    assert sorted(p.name for p in (tmp / "out3").iterdir()) == ["drafter.sha256", "drafter.tar.xz.part00", "res.tgz"]

    keep = "lab/gpu_engines/keep_drafter.sh"
    r = _sh(repo, env, keep, "draftdata", str(tmp / "out1"), str(tmp / "out2"))  # ≤ 4 parts (60 MiB) a carry
    assert "carry .gpu/carry/c09: " in r.stdout and "carry .gpu/carry/c09b: " in r.stdout
    assert sorted(p.name for p in (repo / ".gpu/carry/c09b").iterdir()) == ["MANIFEST.sha256", parts[4]]
    assert "carry .gpu/carry/c08: " in _sh(repo, env, keep, "drafter", str(tmp / "out3")).stdout
    for c in ("c01", "c08", "c09", "c09b"):  # a later window: the wheels' carry, then the kept ones; manifests merge
        _sh(repo, env, "lab/gpu_engines/device.sh", "stash", f".gpu/carry/{c}")
    names = [line.split()[1] for line in (tmp / "eng/MANIFEST.sha256").read_text().splitlines()]
    assert {"vllm.tar", "vllm.tar.part00", "drafter.tar.xz", "draftdata.tar.xz", "draftdata.tar.xz.part00"} <= set(names)
    for kept in ("drafter", "draftdata"):
        _sh(repo, env, "lab/gpu_engines/device.sh", "install", kept)
    drafter = tmp / "eng/drafter/drafter/model.safetensors"
    assert drafter.read_bytes() == (repo / "data/drafter/model.safetensors").read_bytes()
    back = tmp / "eng/draftdata"
    assert sorted(p.name for p in back.iterdir()) == ["features", "validated.json"]
    for f in ("features/shard-00000.safetensors", "features/manifest.json", "validated.json"):
        assert (back / f).read_bytes() == (repo / "data" / f).read_bytes(), f


def test_watch_holds_the_machine_past_a_step_that_ends_well_and_returns_at_one_that_fails(window):
    """Every return is a round trip that may lose the machine (30 s idle): the sixteenth window lost its draft
    when watch returned at draft-train's end. So a step that ends with rc=0 keeps the call waiting; rc≠0 ends it."""
    import time

    repo, env, tmp = window
    (tmp / "res/DONE").unlink()  # the pipeline still running
    steps = tmp / "res/steps.txt"
    cmd = ["bash", "lab/gpu_engines/suite.sh", "watch", "60"]
    w = subprocess.Popen(cmd, cwd=repo, env={**os.environ, **env, "OUT": str(tmp / "outw")},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(2)
        steps.write_text(steps.read_text() + "draft-train rc=0 900s-since-start 400s\n")
        time.sleep(8)  # a 5 s poll has seen it
        assert w.poll() is None, "watch returned at a step that ended well"
        t0 = time.monotonic()
        steps.write_text(steps.read_text() + "draft-simgap rc=124 1200s-since-start 300s\n")
        out, _ = w.communicate(timeout=20)
        assert time.monotonic() - t0 < 12
        assert "draft-simgap rc=124" in out
    finally:
        w.kill()


def test_parts_that_do_not_make_the_kept_tar_are_refused(window):
    repo, env, tmp = window
    _sh(repo, {**env, "OUT": str(tmp / "out0")}, "lab/gpu_engines/suite.sh", "data-keep")
    _sh(repo, {**env, "OUT": str(tmp / "out1")}, "lab/gpu_engines/suite.sh", "watch", "5", check=False)
    part = tmp / "out1/draftdata.tar.xz.part01"
    b = bytearray(part.read_bytes())
    b[1000] ^= 0xFF  # one byte changed in transit
    part.write_bytes(bytes(b))
    _sh(repo, {**env, "OUT": str(tmp / "out2")}, "lab/gpu_engines/suite.sh", "watch", "5", check=False)
    keep = "lab/gpu_engines/keep_drafter.sh"
    r = _sh(repo, env, keep, "draftdata", str(tmp / "out1"), str(tmp / "out2"), check=False)
    assert r.returncode == 1 and "do not make the draftdata.tar.xz" in r.stderr
    r = _sh(repo, env, keep, "draftdata", str(tmp / "out2"), check=False)  # a part missing: refused too
    assert r.returncode == 1 and "do not make the draftdata.tar" in r.stderr
    r = _sh(repo, env, keep, "features", str(tmp / "out1"), check=False)
    assert r.returncode == 2 and "drafter or draftdata" in r.stderr


def test_slim_keeps_counts_of_equal_outputs_not_the_token_ids(tmp_path):
    """lab/h200_engines.py slim: drafted-vs-plain equality per prompt, where the first pairs differ, and
    plain-vs-the-other-engine's plain on the same prompts in the same dtype; the token lists are dropped."""
    def serve(name, engine, dtype, draft, plain):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"engine": engine, "dtype": dtype, "prompt_ids": ["a", "b", "c"], "tau": 2.0,
                                 "speedup": 1.1, "outputs_draft": draft, "outputs_plain": plain}))
        return str(f)

    v = serve("v", "vllm", "bfloat16", [[1, 2, 3], [4, 5], [6, 7, 8]], [[1, 2, 3], [4, 9], [6, 7, 8]])
    s = serve("s", "sglang", "bfloat16", [[1, 2, 3], [4, 5], [7]], [[1, 2, 3], [4, 5], [6, 7, 8]])
    f = serve("f", "vllm", "float32", [[1]], [[1]])
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run([sys.executable, str(REPO / "lab" / "h200_engines.py"), "slim", v, s, f, "--tag", "_x",
                    "--dest", str(out), "--note", "n"], check=True, capture_output=True)
    got = {n: json.loads((out / f"{n}_x.json").read_text()) for n in ("v", "s", "f")}
    assert got["v"]["outputs_equal_count"] == "2/3" and got["v"]["first_differences_at_token"] == [1]
    assert got["s"]["outputs_equal_count"] == "2/3" and got["s"]["first_differences_at_token"] == [0]
    assert got["v"]["plain_equal_to_the_other_engine_plain"] == "2/3 (sglang, bfloat16)"
    assert got["s"]["plain_equal_to_the_other_engine_plain"] == "2/3 (vllm, bfloat16)"
    assert "plain_equal_to_the_other_engine_plain" not in got["f"] and got["f"]["outputs_equal_count"] == "1/1"
    assert all("outputs_draft" not in r and "outputs_plain" not in r and r["note"] == "n" for r in got.values())


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs util-linux's setsid (suite.sh pipeline runs under it)")
def test_a_new_pipeline_stops_the_one_still_running(window):
    """The seventeenth window restarted the pipeline after a watch returned at a worker's Traceback, while the
    old extract's other workers ran on in the same scratch folder: both failed. `suite.sh pipeline` now stops the
    running pipeline's whole session first. Its pipeline.sh here is a stand-in step that outlives the call."""
    import time

    repo, env, tmp = window
    (repo / "lab/gpu_engines/pipeline.sh").write_text(
        'echo "start" > "$OUT/steps.txt"; sleep 300 & echo $! > "$OUT/child.pid"; wait\n')
    env = {**env, "RUN_REPO": str(tmp / "run"), "OUT": str(tmp / "out")}
    res = tmp / "res"

    def alive(pid: int) -> bool:
        return subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0

    _sh(repo, env, "lab/gpu_engines/suite.sh", "pipeline")
    first, first_child = int((res / "pipeline.pid").read_text()), int((res / "child.pid").read_text())
    assert alive(first) and alive(first_child)
    try:
        r = _sh(repo, env, "lab/gpu_engines/suite.sh", "pipeline")
        assert f"stopping the pipeline still running (session {first})" in r.stdout
        time.sleep(1)
        assert not alive(first) and not alive(first_child)  # the step's own processes too
        second = int((res / "pipeline.pid").read_text())
        assert second != first and alive(second)
    finally:  # the second stand-in's session
        subprocess.run(["kill", "-KILL", "--", f"-{(res / 'pipeline.pid').read_text().strip()}"], capture_output=True)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed (scripts/setup.sh)")
def test_sglang_variants_name_server_args_and_variables_sglang_has():
    """h200_engines.py's SGLANG_VARIANTS (suite.sh draft-sglang-variants) are run only on the H200, where a misspelt
    server argument would cost a window's engine start: each argument is a ServerArgs field and each variable one
    of SGLang's declared environment variables (the installed SGLang 0.5.23; the H200's 0.5.17 has them too:
    server_args.py, environ.py), and each variant drafts the k the draft was exported for or more."""
    from sglang.srt.environ import envs
    from sglang.srt.server_args import ServerArgs

    sys.path.insert(0, str(REPO / "lab"))
    try:
        from h200_engines import SGLANG_VARIANTS
    finally:
        sys.path.remove(str(REPO / "lab"))
    fields = {n for c in ServerArgs.__mro__ for n in getattr(c, "__annotations__", {})}
    assert {"stream_interval", "attention_backend"} <= fields and "no_such_arg" not in fields
    for name, (k, env, args) in SGLANG_VARIANTS.items():
        assert k >= 3, name
        assert set(args) <= fields, (name, set(args) - fields)
        assert all(hasattr(envs, v) for v in env), (name, env)
    assert float(SGLANG_VARIANTS["sim25"][1]["SGLANG_SIMULATE_ACC_LEN"]) == 2.5
