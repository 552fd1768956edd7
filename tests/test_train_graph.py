"""train_drafter with ``train.cuda_graph``: the whole optimizer step replayed as a CUDA graph gives the eager fast
step's losses, evaluations and draft; a graphed run resumes onto its own curve; a non-finite loss inside the graph
stops training before the update, as on the eager path. CUDA cases are skipped elsewhere with the reason; when the
graph applies (eaglepipe.train.step.graph_refusal) is tested everywhere."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import _copy_features, _params, features, peaked_llama  # noqa: F401  (features: the fixture, over tiny_target here)

from eaglepipe.params import TrainParams
from eaglepipe.train.loop import train_drafter
from eaglepipe.train.step import graph_refusal

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA graphs exist only there")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """test_train's peaked random Llama with 2 heads of 16 (flex_attention's CUDA kernel needs head_dim >= 16, so
    the graph holds the flex path a GPU run takes)."""
    return peaked_llama(tmp_path_factory.mktemp("peaked_target_hd16"), heads=2, kv_heads=1)


def _fast(**kw) -> TrainParams:
    return _params(**{"fast": True, "teacher_precision": "tf32", "cuda_graph": True, **kw})


def test_the_graph_applies_to_one_fast_cuda_process_without_accumulation():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert graph_refusal(_fast(), cuda, 1) is None
    assert "train.fast on CUDA" in graph_refusal(_fast(), cpu, 1)
    assert "train.fast on CUDA" in graph_refusal(_params(), cuda, 1)
    assert graph_refusal(_fast(cuda_graph=False), cuda, 1) == "train.cuda_graph is false"
    assert "grad_accum 2" in graph_refusal(_fast(grad_accum=2), cuda, 1)
    assert "2 ranks" in graph_refusal(_fast(), cuda, 2)


@CUDA
def test_graphed_training_equals_the_eager_fast_step(features, tiny_target, tmp_path):  # noqa: F811
    """Same steps, losses (within bf16 autocast's run-to-run rounding), τ_sim per epoch and draft weights; a
    learning rate frozen at capture (a Python float) would leave the weights far apart after the warmup and
    cosine schedule."""
    eager = train_drafter(features, tiny_target, tmp_path / "e", _fast(cuda_graph=False), scratch_dir=tmp_path / "se")
    graph = train_drafter(features, tiny_target, tmp_path / "g", _fast(), scratch_dir=tmp_path / "sg")
    assert graph["cuda_graphs"] >= 1 and eager["cuda_graphs"] == 0
    assert graph["steps"] == eager["steps"] > 6
    torch.testing.assert_close(torch.tensor(graph["losses"]), torch.tensor(eager["losses"]), rtol=2e-3, atol=1e-4)
    assert graph["losses"][-1] < graph["losses"][0]
    for e, ev in eager["evals"].items():
        assert graph["evals"][e]["tau_sim"] == pytest.approx(ev["tau_sim"], abs=2e-3)
    we, wg = load_file(tmp_path / "e" / "model.safetensors"), load_file(tmp_path / "g" / "model.safetensors")
    assert we.keys() == wg.keys()
    for k in we:
        torch.testing.assert_close(wg[k].float(), we[k].float(), rtol=1e-2, atol=2e-3, msg=k)


@CUDA
def test_a_graphed_run_resumes_onto_its_curve(features, tiny_target, tmp_path):  # noqa: F811
    """Stopped after step 4 (checkpoint with the CUDA lr tensor and capturable AdamW state), resumed in a new
    graph: the losses of the uninterrupted graphed run."""
    p = _fast(epochs=2)
    full = train_drafter(features, tiny_target, tmp_path / "a", p, scratch_dir=tmp_path / "sa")
    stopped = train_drafter(features, tiny_target, tmp_path / "b", p, scratch_dir=tmp_path / "sb", stop_after=4)
    assert stopped["stopped_at"] == 4
    resumed = train_drafter(features, tiny_target, tmp_path / "b", p, scratch_dir=tmp_path / "sb")
    assert resumed["resumed_from_step"] == 4 and resumed["cuda_graphs"] >= 1
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"]), rtol=1e-3, atol=1e-5)


@CUDA
def test_a_non_finite_loss_in_the_graph_stops_before_the_update(features, tiny_target, tmp_path):  # noqa: F811
    """test_train's poisoned sample (finite 3e38 features → NaN loss) under the graph: TrainingError at that step
    naming the sample; the checkpoint left is the step before's, with finite weights. The plain EAGLE-3 draft, as
    there (norm_before_fc would map the row to zeros)."""
    from eaglepipe.data.features import FeatureSet
    from eaglepipe.errors import TrainingError
    from eaglepipe.train.checkpoint import read_checkpoint
    from eaglepipe.train.packing import epoch_rows, split_samples

    p = _fast(epochs=1, checkpoint_every=1, draft_norms=[])
    train = split_samples(FeatureSet(features).refs, p.eval_fraction, p.seed)[0]
    rows = epoch_rows([r.n_tokens for r in train], p.seed, 0, p.batch_tokens)
    step = 3
    victim = train[rows[step - 1][0]].id
    bad = _copy_features(features, tmp_path / "features", {victim: 3e38})
    with pytest.raises(TrainingError, match="non-finite training loss") as e:
        train_drafter(bad, tiny_target, tmp_path / "d", p, scratch_dir=tmp_path / "s")
    assert f"at optimizer step {step}, epoch 0" in str(e.value) and repr(victim) in str(e.value)
    (ckpt,) = (tmp_path / "s").glob("*/ckpt-*.safetensors")
    ck = read_checkpoint(ckpt.parent)
    assert ck["state"].step == step - 1
    assert all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())


@pytest.fixture(scope="module")
def busy_stores(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """A peaked 4-layer Llama (head_dim 16) with the tiny chat tokenizer, and both stores of 160 conversations
    extracted by the hf engine (shards of 8): enough rows that the feature worker is still reading, pinning and
    (online) queueing rows while the step thread captures its graphs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglepipe.data.extract import extract
    from eaglepipe.params import ExtractParams
    from eaglepipe.target.info import read_info
    from eaglepipe.target.tiny import tiny_conversations, tiny_tokenizer

    torch.manual_seed(0)
    target = tmp_path_factory.mktemp("busy_target")
    LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=99, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    root, info, out = tmp_path_factory.mktemp("busy_stores"), read_info(target), {}
    for store in ("features", "tokens"):
        p = ExtractParams(engine="hf", regenerate=False, batch_size=16, shard_size=8, dtype="bfloat16", store=store)
        extract(tiny_conversations(160, answer_words=12), target, info, [1, 2, 3], p, root / store / "features",
                root / store / "scratch", "prompts-hash", gate_samples=3)
        out[store] = root / store / "features"
    return target, out


@CUDA
@pytest.mark.parametrize("store", ["features", "tokens"])
def test_graphed_training_with_the_worker_busy_equals_the_eager_step(busy_stores, store, tmp_path):
    """train_drafter itself, graphed, while its worker thread makes CUDA calls (pinned host batches; online, the
    target's forward) during the captures — which invalidated a capture in CUDA's global mode
    (cudaErrorStreamCaptureInvalidated): the run completes graphed, over many rows of a loss-masked,
    length-packed store, and gives the eager step's losses and τ_sim."""
    target, stores = busy_stores
    p = _fast(epochs=2, batch_tokens=128, packing="length", draft_vocab_size=64)
    eager = train_drafter(stores[store], target, tmp_path / "e", p.model_copy(update={"cuda_graph": False}),
                          scratch_dir=tmp_path / "se")
    graph = train_drafter(stores[store], target, tmp_path / "g", p, scratch_dir=tmp_path / "sg")
    assert eager["cuda_graphs"] == 0 and graph["cuda_graphs"] >= 1
    assert graph["steps"] == eager["steps"] >= 40
    torch.testing.assert_close(torch.tensor(graph["losses"]), torch.tensor(eager["losses"]), rtol=2e-3, atol=1e-4)
    for e, ev in eager["evals"].items():
        assert graph["evals"][e]["tau_sim"] == pytest.approx(ev["tau_sim"], abs=2e-3)
