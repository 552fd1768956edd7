"""A checkpoint is data, not code: training state round-trips exactly through safetensors + JSON, and a file
that is not such a checkpoint (a pickle whose loading would run code) is refused on resume without running it."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import save_file
from test_train import _params, _run_stage, _stage_params, features, tiny_target  # noqa: F401  (fixtures)

from eaglepipe.errors import TrainingError
from eaglepipe.train.loop import train_drafter
from eaglepipe.train.safe_tree import read_tree, write_tree


class Payload:
    """Unpickling it creates ``marker``: what a tampered checkpoint could do at ``torch.load(weights_only=False)``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_tree_round_trips_exactly(tmp_path):
    tree = {"model": {"w": torch.randn(3, 4), "ids": torch.arange(5), "mask": torch.tensor([True, False])},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(0, 2)}},
                          "param_groups": [{"lr": 0.1 / 3, "betas": (0.9, 0.95), "params": [0], "fused": None}]},
            "rng": {"python": (3, tuple(range(625)), None), "torch": torch.get_rng_state()},
            "state": {"losses": [1.5, float("nan"), float("inf")], "curves": [(1, {"train/loss": 2.0})]}}
    write_tree(tmp_path / "t.safetensors", tree, {"rank": "0"})
    got, meta = read_tree(tmp_path / "t.safetensors")
    assert meta["rank"] == "0" and json.loads(meta["sharded"]) == []
    assert got["optimizer"]["state"][0]["step"].shape == ()
    assert got["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)  # a tuple again, not a list
    assert got["rng"]["python"] == tree["rng"]["python"] and got["state"]["curves"] == [(1, {"train/loss": 2.0})]
    losses = got["state"]["losses"]
    assert losses[0] == 1.5 and math.isnan(losses[1]) and losses[2] == math.inf
    for k, v in tree["model"].items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v)
    assert torch.equal(got["rng"]["torch"], tree["rng"]["torch"])
    with pytest.raises(TypeError, match="state/obj: a Payload cannot be stored"):
        write_tree(tmp_path / "u.safetensors", {"state": {"obj": Payload(tmp_path / "x")}}, {})


def test_files_that_are_not_checkpoints_are_refused_naming_them(tmp_path):
    other = tmp_path / "other.safetensors"  # a safetensors file, but not an eaglepipe tree
    save_file({"w": torch.zeros(2)}, str(other))
    pickled = tmp_path / "pickled.safetensors"
    torch.save({"model": torch.zeros(2)}, pickled)
    missing = tmp_path / "missing.safetensors"  # a tree that names a tensor the file lacks
    write_tree(missing, {"model": {"w": torch.zeros(2)}}, {})
    data = missing.read_bytes().replace(b"model/w", b"model/v", 1)  # the header's name, not the JSON's
    missing.write_bytes(data)
    for f in (other, pickled, missing):
        with pytest.raises(TrainingError, match=f"checkpoint {f} is not an eaglepipe checkpoint"):
            read_tree(f)


def test_a_pickled_checkpoint_is_refused_on_resume_and_never_run(features, tiny_target, tmp_path):  # noqa: F811
    """A run stopped at step 2; its checkpoint file replaced by a pickle whose loading would create a marker file
    (live: unpickling a copy does create it). Resuming refuses it naming the file, in the library and as the stage
    (exit 1, one error line, no traceback); the marker never appears; nothing is written."""
    p = _stage_params(tmp_path)
    scratch = tmp_path / "data" / ".scratch" / "drafter"  # the stage's (eaglepipe.stage.scratch_dir_of)
    train_drafter(features, tiny_target, tmp_path / "data" / "drafter", p, scratch_dir=scratch, stop_after=2)
    (ckpt,) = scratch.glob("*/ckpt-*.safetensors")
    marker, proof = tmp_path / "pwned", tmp_path / "proof"
    torch.save({"state": Payload(marker)}, ckpt)
    torch.save({"state": Payload(proof)}, tmp_path / "copy.pt")
    torch.load(tmp_path / "copy.pt", weights_only=False)
    assert proof.exists()  # the payload is live: the old reader would have run it

    with pytest.raises(TrainingError, match=f"checkpoint {ckpt} is not an eaglepipe checkpoint"):
        train_drafter(features, tiny_target, tmp_path / "data" / "drafter", p, scratch_dir=scratch)
    r = _run_stage(features, tiny_target, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert f"checkpoint {ckpt.relative_to(tmp_path)} is not an eaglepipe checkpoint" in line  # the stage's paths
    assert "never unpickled" in line
    assert not marker.exists() and not (tmp_path / "data" / "drafter").exists()

    shutil.rmtree(ckpt.parent)  # what the message says to do: the run trains from the start
    assert _run_stage(features, tiny_target, tmp_path).returncode == 0 and not marker.exists()


def test_a_checkpoint_of_another_shape_is_refused(features, tiny_target, tmp_path):  # noqa: F811
    """A well-formed checkpoint whose weights do not fit this run's draft (copied into its run folder) is refused
    naming it, not half-loaded."""
    p = _params(epochs=1)
    train_drafter(features, tiny_target, tmp_path / "d", p, scratch_dir=tmp_path / "s", stop_after=2)
    (ckpt,) = (tmp_path / "s").glob("*/ckpt-*.safetensors")
    tree, meta = read_tree(ckpt)
    tree["model"]["fc.weight"] = torch.zeros(3, 3)
    write_tree(ckpt, tree, {k: v for k, v in meta.items() if k in ("rank", "files")})
    with pytest.raises(TrainingError, match=f"checkpoint {ckpt} does not fit this run's draft"):
        train_drafter(features, tiny_target, tmp_path / "d", p, scratch_dir=tmp_path / "s")
    assert not (tmp_path / "d").exists()
