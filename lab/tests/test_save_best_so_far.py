"""lab/save_best_so_far.py and `suite.sh ckpt-keep`: the best evaluated epoch of a training still running, kept
as a draft (config.json + model.safetensors) and returned in parts, with the real train_drafter's checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "lab"))

from save_best_so_far import save_best_so_far

LAYERS = [0, 1, 2]


@pytest.fixture(scope="module")
def target_and_features(tmp_path_factory):
    """A random 4-layer Llama target and 16 greedy continuations of it, captured as extract stores them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglepipe.data.features import FeatureSample, ShardWriter
    from eaglepipe.target.tiny import tiny_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=99, max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    root = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    captured = {}
    model.model.norm.register_forward_hook(lambda m, i, o: captured.update(last=i[0]))
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(16):
        ids = torch.randint(3, 99, (1, 4), generator=g)
        with torch.no_grad():
            for _ in range(int(torch.randint(10, 21, (1,), generator=g))):
                ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
            out = model(ids, output_hidden_states=True)
        T = ids.shape[1]
        samples.append(FeatureSample(
            f"s{i}", ids[0], torch.arange(T) + 1 >= 4,
            torch.stack([out.hidden_states[0][0], out.hidden_states[1][0], captured["last"][0]], 1).to(torch.bfloat16),
            captured["last"][0].to(torch.bfloat16)))
    w = ShardWriter(root / "features", root / "scratch", "k", shard_size=8)
    for j in range(2):
        w.write(j, samples[8 * j: 8 * j + 8])
    w.finish({"layers": LAYERS, "target": {"n_layers": 2}}, 2)  # a stand-in manifest, as the training tests write
    return root / "target", root / "features"


def _params():
    from eaglepipe.params import TrainParams

    return TrainParams(draft_vocab_size=64, ttt_steps=3, step_decay=0.8, epochs=2, lr=3e-3, warmup_steps=2,
                       batch_tokens=64, grad_accum=1, grad_clip=1.0, eval_fraction=0.2, checkpoint_every=3, seed=0)


def test_the_best_epoch_so_far_is_kept_and_returned_by_ckpt_keep(target_and_features, tmp_path):
    from eaglepipe.errors import EaglepipeError
    from eaglepipe.model.draft import load_draft
    from eaglepipe.train.checkpoint import read_checkpoint
    from eaglepipe.train.loop import train_drafter

    target, features = target_and_features
    with pytest.raises(EaglepipeError, match="no training checkpoint"):
        save_best_so_far(tmp_path / "none", tmp_path / "interim")
    scratch = tmp_path / "run/data/.scratch/drafter"  # the train_drafter stage's scratch (eaglepipe.stage)
    train_drafter(features, target, tmp_path / "run/data/drafter", _params(), scratch_dir=scratch, stop_after=2)
    with pytest.raises(EaglepipeError, match="no epoch has ended"):
        save_best_so_far(scratch, tmp_path / "interim")
    train_drafter(features, target, tmp_path / "run/data/drafter", _params(), scratch_dir=scratch, stop_after=7)
    info = save_best_so_far(scratch, tmp_path / "interim")
    assert info["epochs_ended"] == 1 and info["epochs"] == 2 and info["step"] == 7 and info["best_epoch"] == 0
    ck = read_checkpoint(next(scratch.glob("*/ckpt-*.safetensors")).parent)
    draft = load_draft(tmp_path / "interim")
    for k, v in ck["state"].best_state.items():
        torch.testing.assert_close(draft.state_dict()[k], v, rtol=0, atol=0)
    assert json.loads((tmp_path / "interim/config.json").read_text())["interim"] == info

    # the same through `suite.sh ckpt-keep` in the pipeline's copy of the repo, as the device runs it
    run_repo, out = tmp_path / "run", tmp_path / "out"
    (run_repo / "lab/gpu_engines").mkdir(parents=True)
    for s in ("gpu_engines/suite.sh", "gpu_engines/device.sh", "save_best_so_far.py"):
        shutil.copy(REPO / "lab" / s, run_repo / "lab" / s)
    env = {**os.environ, "REPO_ROOT": str(run_repo), "RUN_REPO": str(run_repo), "KEEP": str(tmp_path / "keep"),
           "RES": str(tmp_path / "res"), "OUT": str(out),  # python3: this interpreter (device.sh env sets PYTHONPATH)
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", "lab/gpu_engines/suite.sh", "ckpt-keep"], cwd=run_repo, env=env, text=True,
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.split("INTERIM ", 1)[1].splitlines()[0]) == info
    assert sorted(p.name for p in out.iterdir()) == ["drafter.sha256", "drafter.tar.xz.part00"]
    with tarfile.open(out / "drafter.tar.xz.part00") as t:  # one part: the whole (xz) tar
        assert json.loads(t.extractfile("drafter/config.json").read())["interim"] == info
