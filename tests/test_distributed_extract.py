"""extract as data-parallel engine replicas under torchrun (CPU, gloo, the tiny target, hf engine): the same shard
and manifest bytes as one process, whether the stage re-launches itself (extract.nproc_per_node) or torchrun
starts it; a rank killed mid-run loses only its unfinished shards, and the next run redoes them to the same bytes."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from test_extract import REPO, _sha256_tree, project, run_extract

from eaglepipe.data.distributed_extract import Replica, devices_of
from eaglepipe.host import Layout
from eaglepipe.data.features import FeatureSample, FeatureSet, ShardWriter
from eaglepipe.errors import ParamsError
from eaglepipe.params import ExtractParams

N = 8  # conversations, one per shard: rank 0 of 2 extracts shards 0, 2, 4, 6 and rank 1 shards 1, 3, 5, 7
CPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the same device for every layout, on any CI machine


def _run(cmd: list[str] | None, cwd: Path, tiny_target: Path, script: Path | None = None) -> str:
    """Run extract in ``cwd`` (the stage alone, or ``cmd`` + its arguments; ``script`` instead of the stage);
    returns its output, asserting exit 0."""
    if cmd is None:
        proc = run_extract(cwd, tiny_target, env=CPU)
    else:
        args = [str(script)] if script else _stage_args(tiny_target)
        proc = subprocess.Popen([*cmd, *args], cwd=cwd, env={**CPU, "PYTHONPATH": str(REPO)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out
    return out


def _stage_args(tiny_target: Path) -> list[str]:
    return [str(REPO / "stages/extract.py"), str(tiny_target), "prompts/train.jsonl", "features", "extract.json"]


def _two_hosts(cwd: Path, tiny_target: Path) -> str:
    """docs/cluster.md's several-hosts launch, both "hosts" on this one: `torchrun --nnodes 2 --nproc_per_node 1
    --rdzv_backend c10d --rdzv_endpoint HOST:PORT ...` started twice, as each host would run it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "2", "--nproc_per_node", "1",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "extract",
           *_stage_args(tiny_target)]
    procs = [subprocess.Popen(cmd, cwd=cwd, env=CPU, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [proc.communicate(timeout=600)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    return "\n".join(outs)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_target) -> dict[str, str]:
    """sha256 of every file of the features one process writes (manifest + N shards)."""
    cwd = project(tmp_path_factory.mktemp("one"), tiny_target, N, dtype="bfloat16")
    _run(None, cwd, tiny_target)
    return _sha256_tree(cwd / "features")


TORCHRUN = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2"]


@pytest.mark.parametrize("launch", ["param", "torchrun", "two_hosts"])
def test_two_replicas_write_the_bytes_of_one_process(tmp_path, tiny_target, one_process, launch):
    """DP 2 × TP 1: through the stage (extract.nproc_per_node: 2, as `dvc repro` runs it, which re-launches
    itself under torchrun), by torchrun directly on one host, and as two one-rank "hosts" meeting at a c10d
    rendezvous; rank 0 writes the store and the metrics."""
    cwd = project(tmp_path, tiny_target, N, dtype="bfloat16", nproc_per_node=2 if launch == "param" else 1)
    if launch == "two_hosts":
        out = _two_hosts(cwd, tiny_target)
    else:
        out = _run(None if launch == "param" else TORCHRUN, cwd, tiny_target)
    assert ("re-launching under torchrun" in out) == (launch == "param"), out
    assert "extraction replica (rank 0 of 2)" in out and "extraction replica (rank 1 of 2)" in out, out
    assert len(one_process) == N + 1 and _sha256_tree(cwd / "features") == one_process
    metrics = json.loads((cwd / "extract.json").read_text())
    assert metrics["samples"] == N and metrics["resumed_shards"] == 0 and metrics["capture_seconds"] > 0
    assert not any((cwd / ".scratch" / "features").glob("*/*")), "the scratch folder was not emptied"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP 2 on CPU needs a core per rank")
def test_hf_at_tp2_extracts_the_features_of_tp1(tmp_path, tiny_target_tp2):
    """extract.engine hf at tensor_parallel_size 2: the stage re-launches itself as 2 torchrun ranks (gloo, a core
    each) loading the target with transformers' tp_plan="auto", regenerating and capturing in lockstep; rank 0
    writes. The same regenerated tokens as TP 1 and the same features up to the sharded reductions' rounding (not
    the same bytes: the rowwise layers sum partial products in another order); the manifest says TP 2."""
    stores = {}
    for tp in (1, 2):
        cwd = project(tmp_path / f"tp{tp}", tiny_target_tp2, 4, shard_size=2)
        params = yaml.safe_load((cwd / "params.yaml").read_text())
        (cwd / "params.yaml").write_text(yaml.safe_dump({**params, "tensor_parallel_size": tp}))
        out = _run(None, cwd, tiny_target_tp2)
        stores[tp] = FeatureSet(cwd / "features")
    assert "re-launching under torchrun" in out and "tensor-parallel rank of one hf replica (rank 1 of 2)" in out, out
    one, two = stores[1], stores[2]
    assert two.manifest["tensor_parallel_size"] == 2 and "tensor_parallel_size" not in one.manifest
    assert {k: v for k, v in two.manifest.items() if k not in ("tensor_parallel_size", "run_key")} == \
        {k: v for k, v in one.manifest.items() if k != "run_key"}  # same ids, token hashes, counts, engine
    assert len(two) == 4 and [s.id for s in two] == [s.id for s in one]
    for a, b in zip(one, two):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        for x, y in ((a.aux, b.aux), (a.last, b.last)):  # (T, L, H), (T, H) float32
            cos = torch.nn.functional.cosine_similarity(x.double(), y.double(), dim=-1)
            assert cos.min() > 0.99999


def _wait_for(pattern: str, log: Path, proc: subprocess.Popen, seconds: float = 300) -> re.Match:
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        m = re.search(pattern, log.read_text())
        if m:
            return m
        time.sleep(0.01)
    raise AssertionError(f"no {pattern!r} (exit {proc.poll()}):\n{log.read_text()}")


@pytest.mark.parametrize("recovery", ["next_run", "max_restarts"])
def test_killed_rank_loses_only_its_unfinished_shards(tmp_path, tiny_target, one_process, recovery):
    """SIGKILL rank 1 once it has finished shard 1. next_run (the stage, extract.nproc_per_node: 2): torchrun stops
    rank 0, the stage fails, every finished shard stays in scratch whole; the next run redoes only the missing
    shards (the finished ones keep their files). max_restarts (torchrun --max-restarts 1): torchrun starts both
    ranks again and that same launch ends the same way. Either way: the bytes of one process."""
    restart = recovery == "max_restarts"
    cwd = project(tmp_path, tiny_target, N, dtype="bfloat16", nproc_per_node=1 if restart else 2)
    scratch, log = cwd / ".scratch" / "features", tmp_path / "killed.log"
    launcher = [*TORCHRUN, "--max-restarts", "1"] if restart else [sys.executable]
    with open(log, "w") as f:
        proc = subprocess.Popen([*launcher, *_stage_args(tiny_target)], cwd=cwd, env=CPU, stdout=f,
                                stderr=subprocess.STDOUT)
    pid = int(_wait_for(r"replica \(rank 1 of 2\), local rank 1 of 2, pid (\d+)", log, proc).group(1))
    deadline = time.time() + 300
    while time.time() < deadline and not any(scratch.glob("*/shard-00001.safetensors")):
        time.sleep(0.01)
    done = _finished(scratch)  # rank 1 is busy with shard 3 now (or, rarely, just done with it)
    os.kill(pid, signal.SIGKILL)
    if restart:
        assert proc.wait(timeout=600) == 0, log.read_text()
        out = log.read_text()
    else:
        assert proc.wait(timeout=120) != 0
        assert not (cwd / "features" / "manifest.json").exists()
        done = _finished(scratch)
        assert "shard-00001.safetensors" in done and len(done) < N, f"the kill came too late: {sorted(done)}"
        out = _run(None, cwd, tiny_target)
    assert "failed (exitcode: -9) local_rank: 1" in (log.read_text() if restart else out + log.read_text())
    resumed = [int(m) for m in re.findall(r"resuming: (\d+) of 4 shards already written", out)]
    assert sum(resumed) >= len(done) >= 1, out
    for name, mtime in done.items():  # the finished shards were kept, not redone
        assert (cwd / "features" / name).stat().st_mtime_ns == mtime
    assert json.loads((cwd / "extract.json").read_text())["resumed_shards"] == sum(resumed)
    assert _sha256_tree(cwd / "features") == one_process


def _finished(scratch: Path) -> dict[str, int]:
    """name → mtime of the shards in scratch, each checked whole (it parses and carries the run key)."""
    done = {}
    for path in scratch.glob("*/shard-*.safetensors"):
        with safe_open(path, "pt") as s:
            assert s.metadata()["run_key"] == path.parent.name
        done[path.name] = path.stat().st_mtime_ns
    return done


def test_half_written_shard_is_not_finished(tmp_path):
    """What a killed rank (its ``.tmp``) or a crashed host (a shard cut short) leaves is redone, never finished."""
    w = ShardWriter(tmp_path / "out", tmp_path / "scratch", "k", 1)
    sample = FeatureSample("c0", torch.arange(5), torch.ones(5, dtype=torch.bool), torch.ones(5, 2, 4),
                           torch.ones(5, 4))
    w.write(0, [sample])
    shard = tmp_path / "scratch" / "k" / "shard-00000.safetensors"
    whole = shard.read_bytes()
    assert w.done(0)
    shard.rename(str(shard) + ".tmp")  # killed before the rename: only the .tmp exists
    assert not w.done(0)
    shard.write_bytes(whole[: len(whole) // 2])  # the shard's own name, cut short
    assert not w.done(0)
    w.write(0, [sample])
    assert w.done(0) and shard.read_bytes() == whole


def test_devices_and_layout_refusals():
    """Local rank l at TP T gets GPUs l·T … l·T+T−1 of those visible; a layout the host cannot hold is refused
    with the nproc_per_node that fits; ranks do not spawn workers."""
    assert devices_of(Replica(3, 4, 1, 2), 2, ["4", "5", "6", "7"]) == ["6", "7"]
    assert devices_of(Replica(1, 8, 1, 8), 1, [str(g) for g in range(8)]) == ["1"]
    with pytest.raises(ParamsError, match="nproc_per_node = 1"):
        devices_of(Replica(1, 2, 1, 2), 8, [str(g) for g in range(8)])
    assert Replica(1, 2, 1, 2).shards(5) == [1, 3]
    assert Replica.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == \
        Replica(3, 4, 1, 2)
    assert Replica.from_env({}) == Replica(0, 1, 0, 1)
    with pytest.raises(ValueError, match="extract.workers = 2"):
        ExtractParams(workers=2, nproc_per_node=2)


def test_an_hf_tensor_parallel_replica_is_its_whole_world():
    """hf at T > 1: T processes of one device each form one replica whose first rank writes every shard; a torchrun
    of another size is refused (transformers shards over the whole world)."""
    assert Layout.of("hf", 1, 2) == Layout(2, 1, 2) and Layout.of("vllm", 2, 2) == Layout(2, 2, 1)
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    ranks = [Replica.from_env({**env, "RANK": r, "LOCAL_RANK": r}, tp=2) for r in "01"]
    assert [(r.writes, r.shards(3)) for r in ranks] == [(True, [0, 1, 2]), (False, [0, 1, 2])]
    assert Replica.from_env({}, tp=2) == Replica()  # alone: the stage re-launches itself
    with pytest.raises(ParamsError, match="exactly 2 torchrun ranks .* not 4"):
        Replica.from_env({"WORLD_SIZE": "4", "RANK": "0"}, tp=2)


AGREE = """
import os
from eaglepipe.data.distributed_extract import Replica, agree, process_group
from eaglepipe.errors import ParamsError
replica = Replica.from_env()
with process_group(replica):
    agree(replica, "run key", "same")
    try:
        agree(replica, "run key", f"key{replica.rank}")
    except ParamsError as e:
        print(f"rank {replica.rank} refused: {e}", flush=True)
"""


def test_ranks_that_disagree_on_the_run_key_are_refused(tmp_path):
    """Hosts with other params or code would write (and clear) other scratch folders: every rank refuses."""
    (tmp_path / "agree.py").write_text(AGREE)
    out = _run(TORCHRUN, tmp_path, tmp_path, script=tmp_path / "agree.py")
    for rank in (0, 1):
        assert f"rank {rank} refused: the extraction ranks disagree on the run key (by rank: ['key0', 'key1'])" in out
