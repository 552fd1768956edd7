"""The training loop on features captured from the tiny random target: it learns, writes the exported names,
resumes a stopped run onto the identical loss curve, and 2 gloo ranks equal 1 process with grad_accum 2."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eaglepipe.data.features import FeatureSample, ShardWriter
from eaglepipe.params import TrainParams
from eaglepipe.train.checkpoint import read_checkpoint
from eaglepipe.train.loop import train_drafter
from eaglepipe.train.packing import pack, pack_by_length, padding_fraction, split_samples
from eaglepipe.train.step import lr_factor

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
LAYERS = [0, 1, 2]


def peaked_llama(out: Path, heads: int = 4, kv_heads: int = 2) -> Path:
    """A random 2-layer Llama (hidden 32, vocab 99, untied head) whose next-token distributions are peaked
    (initializer_range 0.3; at HF's 0.02 every soft target is nearly uniform and nothing can be learned)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=99, max_position_embeddings=256, initializer_range=0.3,
                      tie_word_embeddings=False, rope_theta=100000.0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    return peaked_llama(tmp_path_factory.mktemp("peaked_target"))


@pytest.fixture(scope="module")
def features(tiny_target, tmp_path_factory) -> Path:
    """16 greedy continuations of the tiny target (prompt 4 tokens, 10–20 generated), captured like extract:
    aux = h[0], h[1], h[2] (h[2] = h[N], the final norm's input); last = h[N]; loss on the generated tokens."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_target).eval()
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
            captured["last"][0].to(torch.bfloat16),  # (T, 32)
        ))
    root = tmp_path_factory.mktemp("features")
    w = ShardWriter(root / "features", root / "scratch", "k", shard_size=8)
    for j in range(2):
        w.write(j, samples[8 * j : 8 * j + 8])
    w.finish({"layers": LAYERS, "target": {"n_layers": 2}}, 2)
    return root / "features"


def _params(**kw) -> TrainParams:
    base = dict(draft_vocab_size=64, ttt_steps=3, step_decay=0.8, epochs=3, lr=3e-3, warmup_steps=2,
                batch_tokens=64, grad_accum=1, grad_clip=1.0, eval_fraction=0.2, checkpoint_every=3, seed=0)
    return TrainParams(**{**base, **kw})


def test_pack_split_and_schedule():
    assert pack([30, 30, 10, 50, 60], [0, 1, 2, 3, 4], 64) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="70 tokens"):
        pack([30, 70], [0, 1], 64)  # a sample is never cut
    # length-grouped: first-fit decreasing inside windows of `group` samples of the shuffled order
    assert pack_by_length([30, 30, 10, 50, 60], [0, 1, 2, 3, 4], 64) == [[4], [3, 2], [0, 1]]
    assert pack_by_length([30, 30, 10, 50, 60], [0, 1, 2, 3, 4], 64, group=2) == [[0, 1], [3, 2], [4]]
    assert padding_fraction([30, 30, 10, 50, 60], [[4], [3, 2], [0, 1]], 64) == 1 - 180 / 192
    s = [FeatureSample(f"s{i}", *([None] * 4)) for i in range(10)]
    tr, ev = split_samples(s, 0.2, seed=0)
    assert len(ev) == 2 and len(tr) == 8 and [x.id for x in split_samples(s[::-1], 0.2, 0)[1]] == [x.id for x in ev][::-1]
    assert [round(lr_factor(i, 2, 6), 4) for i in range(7)] == [0.5, 1.0, 1.0, 0.8536, 0.5, 0.1464, 0.0]


def test_train_learns_and_writes_the_draft(features, tiny_target, tmp_path):
    out = tmp_path / "drafter"
    s = train_drafter(features, tiny_target, out, _params(epochs=8, lr=1e-2, packing="length"), scratch_dir=tmp_path / "scratch",
                      live_dir=tmp_path / "live")
    assert s["losses"][-1] < 0.7 * s["losses"][0]
    assert s["best"]["tau_sim"] >= s["evals"]["epoch0"]["tau_sim"] and s["best"]["tau_sim"] > 1.0
    w = load_file(str(out / "model.safetensors"))
    assert set(w) == {"fc.weight", "input_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {  # norms on
        f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm",
                                         "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert w["fc.weight"].shape == (32, 96) and w["lm_head.weight"].shape == (64, 32) and w["t2d"].sum() == 64
    assert w["input_norm.weight"].shape == (96,)  # norm_before_fc: one RMSNorm over the 3 concatenated aux states
    assert (w["d2t"] + torch.arange(64)).tolist() == w["t2d"].nonzero().flatten().tolist()
    assert json.loads((out / "config.json").read_text())["layers"] == LAYERS
    assert (tmp_path / "live" / "metrics.json").exists() and not list((tmp_path / "scratch").glob("*/ckpt-*"))
    plots = {p.name for p in (tmp_path / "live" / "plots" / "metrics" / "train").iterdir()}
    assert {"loss.tsv", "acc_step0.tsv", "acc_step2.tsv", "lr.tsv"} <= plots


@pytest.mark.parametrize("stop", [4, 5])  # mid-epoch, and right before the end-of-epoch evaluation
def test_stopped_run_resumes_onto_the_same_curve(features, tiny_target, tmp_path, stop):
    p = _params(epochs=2)
    full = train_drafter(features, tiny_target, tmp_path / "a", p, scratch_dir=tmp_path / "sa")
    part = train_drafter(features, tiny_target, tmp_path / "b", p, scratch_dir=tmp_path / "sb", stop_after=stop)
    assert part["stopped_at"] == stop and len(list((tmp_path / "sb").glob("*/ckpt-*.safetensors"))) == 1
    resumed = train_drafter(features, tiny_target, tmp_path / "b", p, scratch_dir=tmp_path / "sb")
    assert resumed["resumed_from_step"] == stop and full["resumed_from_step"] == 0
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"]), rtol=0, atol=0)
    assert resumed["evals"] == full["evals"]
    wa, wb = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=0)
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()


DDP_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from eaglepipe.params import TrainParams
    from eaglepipe.train.loop import train_drafter
    torch.set_num_threads(1)
    features, target, out, scratch, params = sys.argv[1:6]
    s = train_drafter(features, target, out, TrainParams(**json.loads(params)), scratch_dir=scratch)
    json.dump(s["losses"], open(f"{out}.rank{torch.distributed.get_rank()}.json", "w"))
""")


@pytest.mark.parametrize("fast", [False, True])  # the fast step's fused loss must feed DDP's gradient hooks too
def test_two_gloo_ranks_equal_one_process_with_grad_accum_2(features, tiny_target, tmp_path, fast):
    p = _params(epochs=2, batch_tokens=32, fast=fast)
    one = train_drafter(features, tiny_target, tmp_path / "one",
                        _params(epochs=2, batch_tokens=32, grad_accum=2, fast=fast), scratch_dir=tmp_path / "s1")
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
         str(script), str(features), str(tiny_target), str(tmp_path / "two"), str(tmp_path / "s2"),
         json.dumps(p.model_dump())],
        check=True, env=env, timeout=300, cwd=tmp_path,
    )
    l0 = json.loads((tmp_path / "two.rank0.json").read_text())
    l1 = json.loads((tmp_path / "two.rank1.json").read_text())
    assert l0 == l1 and len(l0) == len(one["losses"])
    torch.testing.assert_close(torch.tensor(l0), torch.tensor(one["losses"]), rtol=1e-4, atol=1e-5)
    w1, w2 = load_file(str(tmp_path / "one" / "model.safetensors")), load_file(str(tmp_path / "two" / "model.safetensors"))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5)


def _stage_params(tmp_path, **train) -> TrainParams:
    """Write a one-epoch tiny params.yaml in ``tmp_path`` (``train`` overrides its train section); its train
    params, validated as the stage reads them."""
    from eaglepipe.params import load_params

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["layers"] = LAYERS
    params["train"].update({"draft_vocab_size": 64, "epochs": 1, "batch_tokens": 64, "warmup_steps": 1, **train})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return load_params(tmp_path / "params.yaml").train


def _run_stage(features, tiny_target, tmp_path, **train):
    """stages/train_drafter.py on ``features`` with :func:`_stage_params`'s params.yaml in ``tmp_path`` (its cwd;
    outputs under data/, metrics/, reports/, dvclive/ there)."""
    _stage_params(tmp_path, **train)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(REPO / "stages" / "train_drafter.py"), str(features), str(tiny_target),
                           "data/drafter", "metrics/train_drafter.json", "reports/train.json", "dvclive/train_drafter"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)


def test_stage_script(features, tiny_target, tmp_path):
    r = _run_stage(features, tiny_target, tmp_path)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "reports" / "train.json").read_text())
    assert m["best"]["tau_sim"] >= 1.0 and m["params"]["layers"] == LAYERS and m["train_tokens"] > 0
    compact = json.loads((tmp_path / "metrics" / "train_drafter.json").read_text())
    assert compact == {"tau_sim": m["best"]["tau_sim"], "epoch": m["best"]["epoch"], "acc": m["best"]["acc"],
                       "tokens_per_s": m["tokens_per_s"]}
    assert (tmp_path / "data" / "drafter" / "model.safetensors").exists()
    assert (tmp_path / "dvclive" / "train_drafter" / "metrics.json").exists()
    assert not (tmp_path / "dvc.yaml").exists()  # dvclive must not write the pipeline's dvc.yaml


def _copy_features(features: Path, dst: Path, poison: dict | None = None) -> Path:
    """A copy of the store; ``poison`` {sample id: value} rewrites that sample's aux (shard rewritten by
    save_shard, manifest bytes updated) — a store damaged after extract, which quarantines such samples."""
    import shutil

    from safetensors import safe_open

    from eaglepipe.data.features import save_shard

    shutil.copytree(features, dst)
    man = json.loads((dst / "manifest.json").read_text())
    for sid, value in (poison or {}).items():
        row = next(s for s in man["samples"] if s["id"] == sid)
        path = dst / row["shard"]
        with safe_open(path, "pt") as f:
            meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        j = json.loads(meta["sample_ids"]).index(sid)
        a, b = int(t["offsets"][j]), int(t["offsets"][j + 1])
        t["aux"][a:b] = value
        save_shard(t, path, meta)
        next(s for s in man["shards"] if s["file"] == row["shard"])["bytes"] = path.stat().st_size
    (dst / "manifest.json").write_text(json.dumps(man))
    return dst


def _train_ids(features: Path, p: TrainParams) -> list[str]:
    from eaglepipe.data.features import FeatureSet

    return [r.id for r in split_samples(FeatureSet(features).refs, p.eval_fraction, p.seed)[0]]


def test_sample_longer_than_batch_tokens_is_refused(features, tiny_target, tmp_path):
    from eaglepipe.data.features import FeatureSet
    from eaglepipe.errors import TrainingError

    longest = max(FeatureSet(features).refs, key=lambda r: r.n_tokens)
    n_long = sum(r.n_tokens > 16 for r in FeatureSet(features).refs)
    with pytest.raises(TrainingError) as e:
        train_drafter(features, tiny_target, tmp_path / "d", _params(batch_tokens=16), scratch_dir=tmp_path / "s")
    msg = str(e.value)
    assert f"sample {longest.id!r} in {longest.shard} has {longest.n_tokens} tokens" in msg
    assert f"({n_long} of 16 samples are longer)" in msg and "batch_tokens is 16" in msg
    assert not (tmp_path / "d").exists()


def test_first_non_finite_finds_the_first_bad_sample_with_one_reduction():
    """The row-wise check: the first sample with a NaN/inf in aux or last, its tensor and exact count; a
    finite sample whose float32 sum overflows is not flagged; tokens-store samples without features pass."""
    from eaglepipe.data.features import FeatureSample
    from eaglepipe.train.stream import first_non_finite

    def sample(i, aux=0.0, last=0.0, features=True):
        ids = torch.arange(4)
        if not features:
            return FeatureSample(f"s{i}", ids, ids > 0, None, None)
        return FeatureSample(f"s{i}", ids, ids > 0, torch.full((4, 2, 3), aux), torch.full((4, 3), last))

    ok = [sample(0), sample(1, features=False), sample(2, aux=3e38)]  # 24 × 3e38 overflows the sum, not a value
    assert first_non_finite(ok) is None and first_non_finite([]) is None
    row = ok + [sample(3, last=float("inf")), sample(4, aux=float("nan"))]
    assert first_non_finite(row) == (3, {"id": "s3", "tensor": "last", "non_finite": 12})
    row[3] = sample(3)
    assert first_non_finite(row) == (4, {"id": "s4", "tensor": "aux", "non_finite": 24})


def test_nan_in_a_shard_stops_training_naming_it(features, tiny_target, tmp_path):
    """A NaN in one sample's features: TrainingError naming the sample and its shard, no draft written."""
    from eaglepipe.errors import TrainingError

    p = _params(epochs=2)
    victim = _train_ids(features, p)[3]
    bad = _copy_features(features, tmp_path / "features", {victim: float("nan")})
    with pytest.raises(TrainingError, match="non-finite values in aux") as e:
        train_drafter(bad, tiny_target, tmp_path / "d", p, scratch_dir=tmp_path / "s")
    shard = json.loads((bad / "manifest.json").read_text())["samples"]
    shard = next(s["shard"] for s in shard if s["id"] == victim)
    assert f"sample {victim!r} in {bad / shard}" in str(e.value)
    assert not (tmp_path / "d").exists()


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(features, tiny_target, tmp_path):
    """Finite but huge features (3e38) overflow the draft to a NaN loss: training stops before that optimizer
    step, names the step's samples, and leaves the checkpoint of the step before it, whose weights are finite.
    The plain EAGLE-3 draft: norm_before_fc's RMSNorm maps such a row to zeros, a finite loss."""
    from eaglepipe.data.features import FeatureSet
    from eaglepipe.errors import TrainingError
    from eaglepipe.train.packing import epoch_rows

    p = _params(epochs=1, checkpoint_every=1, draft_norms=[])
    train = split_samples(FeatureSet(features).refs, p.eval_fraction, p.seed)[0]
    rows = epoch_rows([r.n_tokens for r in train], p.seed, 0, p.batch_tokens)
    step = 3  # grad_accum 1: row k is optimizer step k + 1
    victim = train[rows[step - 1][0]].id
    bad = _copy_features(features, tmp_path / "features", {victim: 3e38})
    with pytest.raises(TrainingError, match="non-finite training loss") as e:
        train_drafter(bad, tiny_target, tmp_path / "d", p, scratch_dir=tmp_path / "s")
    assert f"at optimizer step {step}, epoch 0" in str(e.value) and repr(victim) in str(e.value)
    (ckpt,) = (tmp_path / "s").glob("*/ckpt-*.safetensors")
    assert f"the last good checkpoint {ckpt} is kept" in str(e.value)
    ck = read_checkpoint(ckpt.parent)
    assert ck["state"].step == step - 1
    assert all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())
    assert not (tmp_path / "d").exists()


def test_dvclive_history_survives_a_resume(features, tiny_target, tmp_path):
    """Stopped at step 4, the dvclive folder emptied (as dvc repro does with outs), resumed: every curve holds
    every step from the start, equal to an uninterrupted run's."""
    import csv
    import shutil

    def tsv(live: Path, name: str) -> list[tuple[int, float]]:
        with open(live / "plots" / "metrics" / f"{name}.tsv") as f:
            return [(int(r["step"]), float(r[name.split("/")[-1]])) for r in csv.DictReader(f, delimiter="\t")]

    p = _params(epochs=2)
    full = train_drafter(features, tiny_target, tmp_path / "a", p, scratch_dir=tmp_path / "sa", live_dir=tmp_path / "la")
    train_drafter(features, tiny_target, tmp_path / "b", p, scratch_dir=tmp_path / "sb", live_dir=tmp_path / "lb",
                  stop_after=4)
    shutil.rmtree(tmp_path / "lb")
    train_drafter(features, tiny_target, tmp_path / "b", p, scratch_dir=tmp_path / "sb", live_dir=tmp_path / "lb")
    loss = tsv(tmp_path / "lb", "train/loss")
    assert [s for s, _ in loss] == list(range(1, full["steps"] + 1))
    assert loss == tsv(tmp_path / "la", "train/loss")
    assert tsv(tmp_path / "lb", "eval/tau_sim") == tsv(tmp_path / "la", "eval/tau_sim")
    assert len(tsv(tmp_path / "lb", "eval/tau_sim")) == 2
    assert 0.0 <= full["padding_fraction"] < 1.0


def test_stage_names_a_truncated_shard(features, tiny_target, tmp_path):
    """train_drafter on a store whose second shard was cut: exit 1, one error line naming the file, no traceback."""
    bad = _copy_features(features, tmp_path / "features")
    shard = bad / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    r = _run_stage(bad, tiny_target, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert f"feature shard {shard}: 1000 bytes, manifest says" in line
    assert not (tmp_path / "data" / "drafter").exists()


def test_fast_step_trains_the_same_and_lm_head_can_be_frozen(features, tiny_target, tmp_path):
    p = _params(epochs=2)
    plain = train_drafter(features, tiny_target, tmp_path / "a", p, scratch_dir=tmp_path / "sa")
    fast = train_drafter(features, tiny_target, tmp_path / "b", _params(epochs=2, fast=True), scratch_dir=tmp_path / "sb")
    torch.testing.assert_close(torch.tensor(fast["losses"]), torch.tensor(plain["losses"]), rtol=1e-4, atol=1e-5)
    assert fast["best"]["tau_sim"] == pytest.approx(plain["best"]["tau_sim"], abs=1e-3)
    frozen = train_drafter(features, tiny_target, tmp_path / "c", _params(epochs=1, freeze_lm_head=True),
                           scratch_dir=tmp_path / "sc")
    w, init = load_file(str(tmp_path / "c" / "model.safetensors")), load_file(str(tmp_path / "a" / "model.safetensors"))
    assert frozen["steps"] > 0 and not torch.equal(w["fc.weight"], init["fc.weight"])
    from eaglepipe.model.target_head import load_target_head

    head = load_target_head(tiny_target)
    torch.testing.assert_close(w["lm_head.weight"], head.lm_head[w["t2d"]], rtol=0, atol=0)  # never trained


def test_sim_gap_reproduces_the_held_out_evaluation(features, tiny_target, tmp_path):
    """benchmarks/sim_gap.py's ``sim`` on train_drafter's own held-out samples gives the kept (best) epoch's
    evaluation: the same per-step accuracies, so its τ_sim on serving prompts compares like with like."""
    from benchmarks.sim_gap import sim
    from eaglepipe.data.features import FeatureSet

    p = _params(epochs=4, lr=1e-2)
    s = train_drafter(features, tiny_target, tmp_path / "drafter", p, scratch_dir=tmp_path / "scratch")
    fs = FeatureSet(features)
    held = [fs.read(r) for r in split_samples(fs.refs, p.eval_fraction, p.seed)[1]]
    got = sim(tmp_path / "drafter", tiny_target, held, p.ttt_steps, p.step_decay, p.batch_tokens)
    want = [s["best"]["acc"][f"step{j}"] for j in range(p.ttt_steps)]
    assert got["acc"] == pytest.approx(want, abs=1e-4) and got["tau_sim"] == pytest.approx(s["best"]["tau_sim"], abs=1e-4)
    assert got["positions"] == sum(int(x.loss_mask.sum()) for x in held) and 0 < got["acc"][0] < 1


def test_compile_stats_counts_what_torch_compile_compiled():
    """The epoch log's compile figures come from dynamo's own counters: a new compiled function adds one graph
    and its compile seconds."""
    from eaglepipe.train.curves import compile_stats

    graphs, seconds = compile_stats()
    f = torch.compile(lambda x: (x * 3).cos().sum(), dynamic=False)
    f(torch.randn(5))
    graphs2, seconds2 = compile_stats()
    assert graphs2 == graphs + 1
    assert seconds2 > seconds
    f(torch.randn(5))  # same shape: no new graph
    assert compile_stats()[0] == graphs2
