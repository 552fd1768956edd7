"""Training on several processes: the train_drafter stage launches its own torchrun ranks
(``train.nproc_per_node``), and 2 gloo ranks — DDP, or FSDP2 with sharded checkpoints — train what one process
trains with grad_accum 2 on the same micro-batches; an FSDP2 run stopped and resumed from its shards retraces
the uninterrupted run."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_train import _params, _run_stage, _stage_params, features, tiny_target  # noqa: F401  (fixtures)
from torch.utils._pytree import tree_flatten, tree_unflatten

from eaglepipe.train.checkpoint import read_checkpoint
from eaglepipe.train.distributed import launch_ranks
from eaglepipe.train.loop import train_drafter
from eaglepipe.train.safe_tree import read_meta
from eaglepipe.train.ttt.batch import TTTResult


def _assert_same_draft(got: str, want: str, tol: float) -> None:
    """Two drafts in the same format (tensor names, dtypes, shapes, safetensors metadata), values within ``tol``."""
    a, b = load_file(got), load_file(want)
    assert sorted(a) == sorted(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol / 10)
    with safe_open(got, "pt") as f, safe_open(want, "pt") as g:
        assert f.metadata() == g.metadata() == {"format": "pt"}


def test_fsdp2_finds_the_loss_in_the_unroll_result():
    """FSDP2 of torch < 2.13 finds a forward's output tensors with tree_flatten, and hooks the backward only where
    it finds one: the unroll's result is a pytree node whose leaves are its tensors, loss first."""
    r = TTTResult(*(torch.full((2,), float(i)) for i in range(5)))
    leaves, spec = tree_flatten(r)
    assert [x is getattr(r, f) for x, f in zip(leaves, ("loss", "step_loss", "correct", "counted", "trained"))] == [True] * 5
    back = tree_unflatten([x + 1 for x in leaves], spec)
    assert isinstance(back, TTTResult) and back.loss.tolist() == [1.0, 1.0] and back.trained.tolist() == [5.0, 5.0]


def test_launch_ranks_launches_only_from_outside_torchrun(monkeypatch):
    assert launch_ranks(1) is None
    monkeypatch.setenv("WORLD_SIZE", "2")  # already a rank: the caller trains
    assert launch_ranks(2) is None


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_stage_launches_two_ranks_equal_to_one_process(features, tiny_target, tmp_path, parallel):  # noqa: F811
    """`nproc_per_node: 2` in params.yaml: the stage script alone runs 2 torchrun ranks; rank 0 writes the draft,
    report and metrics; the draft equals one process's with grad_accum 2 (same global batch)."""
    one = _stage_params(tmp_path, epochs=2, grad_accum=2)
    ref = train_drafter(features, tiny_target, tmp_path / "one", one, scratch_dir=tmp_path / "s1")
    r = _run_stage(features, tiny_target, tmp_path, epochs=2, nproc_per_node=2, parallel=parallel)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "reports" / "train.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == ref["steps"] > 2
    assert report["params"]["train"]["parallel"] == parallel and report["resumed_from_step"] == 0
    assert report["final_train_loss"] == pytest.approx(ref["losses"][-1], rel=1e-4)
    for e, ev in ref["evals"].items():
        assert report["evals"][e]["acc"] == pytest.approx(ev["acc"], abs=1e-3)
    _assert_same_draft(str(tmp_path / "data" / "drafter" / "model.safetensors"),
                       str(tmp_path / "one" / "model.safetensors"), 1e-4)
    assert json.loads((tmp_path / "data" / "drafter" / "config.json").read_text())["draft"] == \
        json.loads((tmp_path / "one" / "config.json").read_text())["draft"]
    assert not list((tmp_path / "data" / ".scratch").rglob("ckpt-*"))  # removed once the draft is written


FSDP_SCRIPT = textwrap.dedent("""
    import json, shutil, sys, torch
    from eaglepipe.params import TrainParams
    from eaglepipe.train.loop import train_drafter
    torch.set_num_threads(1)
    features, target, out, params, stop = sys.argv[1:6]
    p = TrainParams(**json.loads(params))
    full = train_drafter(features, target, f"{out}/full", p, scratch_dir=f"{out}/s_full")
    train_drafter(features, target, f"{out}/resumed", p, scratch_dir=f"{out}/s_res", stop_after=int(stop))
    rank = torch.distributed.get_rank()
    if rank == 0:
        shutil.copytree(f"{out}/s_res", f"{out}/s_stopped")  # the sharded checkpoint, kept for the test to read
    torch.distributed.barrier()
    resumed = train_drafter(features, target, f"{out}/resumed", p, scratch_dir=f"{out}/s_res")
    accum = train_drafter(features, target, f"{out}/accum", p.model_copy(update={"grad_accum": 2}),
                          scratch_dir=f"{out}/s_accum")
    json.dump({"full": full["losses"], "resumed": resumed["losses"], "from": resumed["resumed_from_step"],
               "accum": accum["losses"]}, open(f"{out}/rank{rank}.json", "w"))
""")


def test_fsdp_ranks_equal_one_process_and_resume_from_their_shards(features, tiny_target, tmp_path):  # noqa: F811
    """2 gloo ranks under FSDP2: the loss of every step and the written draft equal one process's with
    grad_accum 2 (and with grad_accum 2 a rank, one process's with 4); stopped at step 4 (one checkpoint file a
    rank, each holding half of every weight's rows) and resumed, the run retraces the uninterrupted one exactly."""
    p, stop = _params(epochs=2, batch_tokens=32, parallel="fsdp"), 7  # epoch 0 ended at step 5: a best_state kept
    one = train_drafter(features, tiny_target, tmp_path / "one", _params(epochs=2, batch_tokens=32, grad_accum=2),
                        scratch_dir=tmp_path / "s1")
    four = train_drafter(features, tiny_target, tmp_path / "four", _params(epochs=2, batch_tokens=32, grad_accum=4),
                         scratch_dir=tmp_path / "s4")
    train_drafter(features, tiny_target, tmp_path / "one_stopped", _params(epochs=2, batch_tokens=32, grad_accum=2),
                  scratch_dir=tmp_path / "s1_stopped", stop_after=stop)
    (tmp_path / "fsdp.py").write_text(FSDP_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                    str(tmp_path / "fsdp.py"), str(features), str(tiny_target), str(tmp_path / "two"),
                    json.dumps(p.model_dump()), str(stop)], check=True, env=env, timeout=300, cwd=tmp_path)
    r0, r1 = (json.loads((tmp_path / "two" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 and r0["from"] == stop and len(r0["full"]) == len(one["losses"])
    assert r0["resumed"] == r0["full"]  # exact: the shards restore every weight, AdamW moment and counter
    torch.testing.assert_close(torch.tensor(r0["full"]), torch.tensor(one["losses"]), rtol=1e-4, atol=1e-5)
    assert len(r0["accum"]) == len(four["losses"]) >= 2
    torch.testing.assert_close(torch.tensor(r0["accum"]), torch.tensor(four["losses"]), rtol=1e-4, atol=1e-5)
    two = tmp_path / "two"
    _assert_same_draft(str(two / "full" / "model.safetensors"), str(tmp_path / "one" / "model.safetensors"), 1e-4)
    assert (two / "resumed" / "model.safetensors").read_bytes() == (two / "full" / "model.safetensors").read_bytes()

    files = sorted((tmp_path / "two" / "s_stopped").glob("*/ckpt-*.safetensors"))
    assert [f.name.split(".")[1] for f in files] == ["rank0", "rank1"]
    # rank 1's rows of fc's (32, 96) weight, and of the (96,) input_norm's AdamW moment (parameter 0: norm_before_fc)
    names = {"model/fc.weight": (16, 96), "state/best_state/fc.weight": (16, 96), "optimizer/state/0/exp_avg": (48,)}
    assert all(read_meta(f)["files"] == "2" and set(names) <= set(json.loads(read_meta(f)["sharded"])) for f in files)
    rank1 = load_file(str(files[1]))
    assert {n: tuple(rank1[n].shape) for n in names} == names
    sharded, whole = read_checkpoint(files[0].parent), read_checkpoint(next((tmp_path / "s1_stopped").iterdir()))
    assert sharded["state"].step == whole["state"].step == stop and sharded["state"].best_epoch == 0
    for k, v in whole["model"].items():  # the shards joined are the whole weights one process had at that step
        torch.testing.assert_close(sharded["model"][k], v, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sharded["state"].best_state[k], whole["state"].best_state[k], rtol=1e-4, atol=1e-5)


def test_a_failing_rank_fails_the_stage_with_its_message(features, tiny_target, tmp_path):  # noqa: F811
    """Under the stage's own torchrun a rank's error (here a truncated shard) is printed by the rank, without a
    traceback, and the stage exits with the rank's code."""
    from test_train import _copy_features

    bad = _copy_features(features, tmp_path / "features")
    shard = bad / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    r = _run_stage(bad, tiny_target, tmp_path, nproc_per_node=2)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    errors = {ln for ln in r.stderr.splitlines() if ln.startswith("error:")}
    size = (features / "shard-00001.safetensors").stat().st_size
    line = f"error: feature shard {shard}: 1000 bytes, manifest says {size} bytes (truncated or replaced); re-run extract"
    assert errors == {line}  # each rank prints it; no other error line
    assert not (tmp_path / "data" / "drafter").exists()
