"""The hf engine's capture equals a hand-written forward pass; h[N] is the pre-norm state."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglepipe.engines.hf import HFEngine


def manual_boundaries(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """h[0..N] by hand: embeddings, then each decoder layer in turn (rotary embeddings from the model)."""
    m = model.model
    h = m.embed_tokens(ids)  # shape: (1, T, H)
    pos = torch.arange(ids.shape[1])[None]
    pe = m.rotary_emb(h, pos)
    mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None]
    out = [h]
    for layer in m.layers:
        h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        h = h[0] if isinstance(h, tuple) else h
        out.append(h)
    return [x[0] for x in out]  # N+1 tensors (T, H)


@pytest.fixture(scope="module")
def engine(tiny_target):
    return HFEngine(tiny_target, batch_size=2)


def test_capture_equals_manual_forward(engine, tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    seqs = [[5, 17, 33, 2, 90, 4, 61], [7, 8, 9], [11, 12, 13, 14, 15]]  # 3 sequences, batches of 2 (padding)
    ids = [0, 1, 3, 4]
    caps = engine.capture(seqs, ids)
    assert [tuple(c.shape) for c in caps] == [(7, 4, 32), (3, 4, 32), (5, 4, 32)] and caps[0].dtype == torch.float32
    with torch.no_grad():
        for seq, cap in zip(seqs, caps):
            ref = manual_boundaries(model, torch.tensor([seq]))
            for j, k in enumerate(ids):
                torch.testing.assert_close(cap[:, j], ref[k], rtol=1e-5, atol=1e-5)


def test_compiled_capture_equals_eager(engine, tiny_target):
    """HFEngine(compile=True) (benchmarks/online_train.py's compiled capture) gives eager's states: batches of
    several lengths through one dynamic graph, and a batch of one (padded to two rows: dynamo specializes a size of 1)."""
    torch._dynamo.reset()
    comp = HFEngine(tiny_target, batch_size=2, compile=True)
    seqs = [[5, 17, 33, 2, 90, 4, 61], [7, 8, 9], [11, 12, 13, 14, 15], list(range(20, 61))]
    for batch in (seqs, seqs[3:], seqs[1:3]):
        for got, want in zip(comp.capture(batch, [0, 2, 4]), engine.capture(batch, [0, 2, 4])):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_last_boundary_is_pre_norm(engine, tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    h_n = engine.capture([seq], [4])[0][:, 0]  # N = 4
    with torch.no_grad():
        hf = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    # HF's last entry is AFTER the final norm; ours is before it and becomes it through model.norm
    assert (h_n - hf[4][0]).abs().max() > 1e-2
    torch.testing.assert_close(model.model.norm(h_n), hf[4][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(engine.capture([seq], [3])[0][:, 0], hf[3][0], rtol=1e-5, atol=1e-5)


def test_bad_ids_and_generate(engine):
    with pytest.raises(ValueError, match=r"\[5\]"):
        engine.capture([[1, 2]], [0, 5])
    outs = engine.generate([[5, 6, 7], [8, 9]], max_new_tokens=4)
    assert len(outs) == 2 and all(1 <= len(o) <= 4 for o in outs)
    # greedy = argmax continuation, token by token, for the unpadded prompt
    ref = engine.model.generate(torch.tensor([[8, 9]]), max_new_tokens=4, do_sample=False, pad_token_id=0,
                                eos_token_id=list(engine.eos_ids))[0, 2:].tolist()
    assert outs[1] == ref[: len(outs[1])]


def test_sim_gap_scores_each_continuation_token_once(tiny_target):
    """benchmarks/sim_gap.py's samples: the loss mask is over predictions (eaglepipe/data/template.py), so position t
    is scored iff token t + 1 is one the target generated: every generated token once, no prompt token, and
    features for every position."""
    from benchmarks.sim_gap import samples_on

    prompts = [{"id": "a", "input_ids": [5, 17, 33, 4]}, {"id": "b", "input_ids": [9, 10]}]
    got = samples_on(HFEngine(tiny_target, batch_size=2), prompts, [1, 4], 6, "float32")
    for p, s in zip(prompts, got):
        scored = {t + 1 for t in torch.nonzero(s.loss_mask).flatten().tolist()}
        assert len(s.input_ids) > len(p["input_ids"]) and s.input_ids[: len(p["input_ids"])].tolist() == p["input_ids"]
        assert scored == set(range(len(p["input_ids"]), len(s.input_ids)))
        assert s.aux.shape == (len(s.input_ids), 1, 32) and s.last.shape == (len(s.input_ids), 32)


def test_an_option_no_engine_takes_is_refused_before_anything_starts(tmp_path):
    """get_engine: an engine's own argument passed bare (SGLang's attention_backend, vLLM's
    gpu_memory_utilization) was dropped without a word; now refused, naming where it goes. Options that one
    engine takes and another ignores (batch_size: hf and vllm; max_total_tokens: sglang) stay accepted."""
    from eaglepipe.engines import engine_options, get_engine
    from eaglepipe.errors import ParamsError

    with pytest.raises(ParamsError, match=r"attention_backend are taken by no engine.*engine_kwargs"):
        get_engine("sglang", tmp_path / "no-target", attention_backend="triton")
    with pytest.raises(ParamsError, match=r"gpu_memory_utilization .*llm_kwargs"):
        get_engine("vllm", tmp_path / "no-target", gpu_memory_utilization=0.3)
    assert {"batch_size", "max_total_tokens", "engine_kwargs", "llm_kwargs", "dtype", "info"} <= engine_options()
