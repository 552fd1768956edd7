"""validate_offsets' comparison on the hf engine: planted translator offsets −2..+2 are named exactly."""

import importlib.util
import re

import pytest
import torch

from eaglepipe.contract import convention
from eaglepipe.contract.validate import check_offsets, require_ok
from eaglepipe.data.features import FeatureSample
from eaglepipe.engines.hf import HFEngine
from eaglepipe.errors import CaptureMismatch

SEQS = [[5, 17, 33, 2, 90, 4, 61, 7], [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def engine(tiny_target):
    return HFEngine(tiny_target)


@pytest.fixture(scope="module")
def stored(engine):
    """Samples 'extracted' at boundaries [2] (N = 4), stored in bfloat16 like the default."""
    caps = engine.capture(SEQS, [2, 4])
    return [FeatureSample(f"s{i}", torch.tensor(s), torch.ones(len(s), dtype=torch.bool),
                          c[:, :1].bfloat16(), c[:, 1].bfloat16()) for i, (s, c) in enumerate(zip(SEQS, caps))]


def test_clean_run_passes(engine, stored):
    rep = check_offsets(engine, "llama", 4, [2], stored, search=2, min_cosine=0.999)
    assert rep.ok and rep.message() == ""
    (r,) = rep.layers
    assert (r.boundary, r.engine_id, r.best_offset) == (2, 2, 0) and r.cosine > 0.9999
    assert sorted(r.cosines) == [-2, -1, 0, 1, 2] and max(r.cosines[d] for d in (-2, -1, 1, 2)) < 0.999
    assert [row["engine"] for row in rep.table()] == [0, 1, 2, 3, 4]
    require_ok(rep)


@pytest.mark.parametrize("planted", [-2, -1, 1, 2])
def test_planted_offset_is_named(engine, stored, monkeypatch, planted):
    """A translator that writes k + planted makes the hf engine feed h[k + planted]: reported as that offset."""
    real = convention.engine_ids

    def buggy(eng, family, boundaries, n, version=None):
        ids = real(eng, family, boundaries, n, version)
        return [i + planted for i in ids]

    monkeypatch.setattr(convention, "engine_ids", buggy)
    rep = check_offsets(engine, "llama", 4, [2], stored, search=2, min_cosine=0.999)
    (r,) = rep.layers
    assert not rep.ok
    assert (r.engine_id, r.best_offset) == (2 + planted, planted) and r.best_cosine > 0.9999
    msg = rep.message()
    assert f"given id {2 + planted} the engine feeds h[{2 + planted}]" in msg
    assert f"off by {planted:+d}" in msg and ("deeper" if planted > 0 else "shallower") in msg
    # the heatmap's engine column is the boundary the engine fed: the stored h[2] peaks at engine h[2]
    best = max(rep.table(), key=lambda row: row["cosine"])
    assert (best["stored"], best["engine"]) == ("h[2]", 2)
    with pytest.raises(CaptureMismatch, match=re.escape(f"off by {planted:+d}")):
        require_ok(rep)


def test_numerics_gap_is_not_an_offset(engine, stored):
    noisy = [FeatureSample(s.id, s.input_ids, s.loss_mask, s.aux + 0.05 * s.aux.std() * torch.randn_like(s.aux.float()).bfloat16(),
                           s.last) for s in stored]
    rep = check_offsets(engine, "llama", 4, [2], noisy, search=2, min_cosine=0.99999)
    assert not rep.ok and rep.layers[0].best_offset == 0
    assert "a numerics gap, not an offset" in rep.message()


# ---------------------------------------------------------------- offset vs numerics gap, on real numerics


@pytest.fixture(scope="module")
def stored_fp32(engine):
    """Samples extracted by the hf engine in float32 and stored in float32 (extract.dtype float32)."""
    caps = engine.capture(SEQS, [2, 4])
    return [FeatureSample(f"s{i}", torch.tensor(s), torch.ones(len(s), dtype=torch.bool), c[:, :1], c[:, 1])
            for i, (s, c) in enumerate(zip(SEQS, caps))]


@pytest.fixture(scope="module")
def bf16_engine(tiny_target):
    """The serving engine computing in bfloat16: its layers differ from the fp32 extraction by rounding only."""
    return HFEngine(tiny_target, dtype="bfloat16")


def test_real_numerics_gap_is_named_at_offset_0_with_its_size(engine, bf16_engine, stored_fp32):
    """fp32 features against a bf16 engine: best match at the exported id, relative L2 measured above the
    threshold (thresholds are params; the tiny model's bf16 gap is ~0.3 %, so they are tight here)."""
    from eaglepipe.contract.validate import reference_capture

    ref = reference_capture(engine, "llama", 4, [2], stored_fp32)  # the same engine in fp32: the baseline
    rep = check_offsets(bf16_engine, "llama", 4, [2], stored_fp32, search=2, min_cosine=0.999999, max_rel_l2=1e-3,
                        reference=ref)
    (r,) = rep.layers
    assert not rep.ok and rep.verdict == "numerics" and r.best_offset == 0
    assert 1e-3 < r.rel_l2 < 0.05 and 0.999 < r.cosine < 1.0  # measured, not planted: bf16 rounding of 3 layers
    assert r.ref_cosine > 0.999999 and r.ref_rel_l2 < 1e-6  # stored = the fp32 engine's own capture
    assert r.gap_rel_l2 == pytest.approx(r.rel_l2, rel=1e-3)  # so the whole gap is the bf16 engine's
    msg = rep.message()
    assert "stored h[2]: numerics gap, offset 0" in msg and "a numerics gap, not an offset" in msg
    assert f"relative L2 {r.rel_l2:.3g} > validate.max_rel_l2 0.001" in msg and "off by" not in msg
    assert "Against hf" in msg and "float32, unquantized" in msg and f"relative L2 {r.gap_rel_l2:.3g}" in msg
    assert rep.engine_dtype == "bfloat16" and rep.compact()["max_rel_l2_at_0"] == round(r.rel_l2, 6)
    with pytest.raises(CaptureMismatch, match="numerics gap, offset 0"):
        require_ok(rep)
    loose = check_offsets(bf16_engine, "llama", 4, [2], stored_fp32, search=2, min_cosine=0.999, max_rel_l2=0.05)
    assert loose.ok  # the defaults accept a bf16 serving engine on fp32 features


def test_features_captured_as_served_pass_and_the_gap_to_the_float_model_is_reported(engine, bf16_engine):
    """A checkpoint served with other numerics (here the bf16 engine stands in for a quantized one) whose features
    were captured as served: the gate passes, and the gap to the float model (the fp32 engine: target.unquantized)
    is measured and said, not failed."""
    from eaglepipe.contract.validate import reference_capture

    caps = bf16_engine.capture(SEQS, [2, 4])
    served = [FeatureSample(f"s{i}", torch.tensor(s), torch.ones(len(s), dtype=torch.bool), c[:, :1], c[:, 1])
              for i, (s, c) in enumerate(zip(SEQS, caps))]
    ref = reference_capture(engine, "llama", 4, [2], served, "float release (target.unquantized)")
    rep = check_offsets(bf16_engine, "llama", 4, [2], served, search=2, min_cosine=0.999999, max_rel_l2=1e-3,
                        reference=ref)
    rep.checkpoint = "W8A8"
    (r,) = rep.layers
    assert rep.ok and r.rel_l2 < 1e-6 and 1e-3 < r.gap_rel_l2 < 0.05  # bf16 against fp32: measured, not planted
    assert r.ref_rel_l2 == pytest.approx(r.gap_rel_l2, rel=1e-3)  # the stored features are the served ones
    c = rep.compact()
    assert (c["verdict"], c["checkpoint"]) == ("ok", "W8A8") and c["max_gap_rel_l2"] == round(r.gap_rel_l2, 6)
    note = rep.gap_note()
    assert note.startswith("numerics gap of the served hf (W8A8, bfloat16) target against hf ")
    assert "float32, float release (target.unquantized)" in note and f"relative L2 {r.gap_rel_l2:.3g}" in note
    assert check_offsets(engine, "llama", 4, [2], served, search=2, min_cosine=0.999).gap_note() == ""


@pytest.mark.parametrize("planted", [-1, 1])
def test_planted_offset_is_still_an_offset_through_a_numerics_gap(bf16_engine, stored_fp32, monkeypatch, planted):
    real = convention.engine_ids
    monkeypatch.setattr(convention, "engine_ids",
                        lambda eng, fam, ks, n, version=None: [i + planted for i in real(eng, fam, ks, n, version)])
    rep = check_offsets(bf16_engine, "llama", 4, [2], stored_fp32, search=2, min_cosine=0.999999, max_rel_l2=1e-3)
    (r,) = rep.layers
    assert rep.verdict == "offset" and r.best_offset == planted
    msg = rep.message()
    assert f"given id {2 + planted} the engine feeds h[{2 + planted}]" in msg and f"off by {planted:+d}" in msg
    assert "numerics gap" not in msg


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="SGLang's DeepSeek rule is read for its installed version (scripts/setup.sh installs it)")
def test_neighbours_are_boundaries_under_sglang_deepseek_first_id_rule():
    """SGLang reads DeepSeek ids [1, …] all as h[i+1]: the neighbour list drops h[1] instead of naming h[6].

    The case that failed on the H200 (6-layer kimi_k2, stored h[3..5], search 2): the id-wise union
    [1..5] is read as h[2..6], and h[6] is past SGLang's capture loop ("captured 4 of 5 aux hidden states").
    """
    from eaglepipe.contract.validate import _neighbour_ids

    can = set(convention.capturable("sglang", "deepseek_v3", 6))
    ids, fed = _neighbour_ids("sglang", "deepseek_v3", [3, 4, 5], can, 2, 6)
    assert (ids, fed) == ([2, 3, 4, 5], [2, 3, 4, 5])
    assert convention.boundaries_of("sglang", "deepseek_v3", ids, 6) == fed
    # Llama's +1 rule keeps every neighbour it can capture (h[1..N-1]): ids = boundaries - 1
    ids, fed = _neighbour_ids("sglang", "llama", [2], set(convention.capturable("sglang", "llama", 4)), 2, 4)
    assert (ids, fed) == ([0, 1, 2], [1, 2, 3])


def test_features_of_another_model_are_a_mismatch_not_an_offset(tiny_target, stored, tmp_path):
    """Stored features from one model, captured through another (same shapes, other weights): no id within
    ±search matches, so the gate names no offset (as for kimi_k2 with vLLM features and an SGLang capture that
    departs from them: best cosines 0.24-0.38 at every shift) and says what that means."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(1)
    LlamaForCausalLM(AutoConfig.from_pretrained(tiny_target)).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_target).save_pretrained(tmp_path)
    rep = check_offsets(HFEngine(tmp_path), "llama", 4, [2], stored, search=2, min_cosine=0.999)
    (r,) = rep.layers
    assert rep.verdict == "mismatch" and not rep.ok and r.best_cosine < 0.9
    msg = rep.message()
    assert "matches no capture" in msg and "no layer offset" in msg
    assert "(off by" not in msg and "numerics gap, offset 0" not in msg
    with pytest.raises(CaptureMismatch, match="no layer offset"):
        require_ok(rep)


def test_report_json_is_stable_across_an_fp32_ulp_of_relative_l2():
    """reports/offsets.json is a DVC output: vLLM's CPU capture moved a relative L2 by one fp32 ulp between two
    fresh clones (0.0016593665350228548 / 0.0016593668842688203), so the report rounds it to 6 digits."""
    import json

    from eaglepipe.contract.validate import LayerReport, OffsetReport

    def report(rel, cos1):
        layer = LayerReport(boundary=2, engine_id=2, cosine=0.9999988079071045, rel_l2=rel, best_offset=0,
                            best_cosine=0.9999988079071045, fed=2, cosines={0: 0.9999988079071045, 1: cos1})
        return OffsetReport("vllm", "0.32.0", "llama", 4, 818, 0.999, [layer])

    a = report(0.0016593665350228548, 0.9672431945800781).to_json()
    b = report(0.0016593668842688203, 0.9672433137893677).to_json()  # one fp32 ulp apart, each (seen here)
    assert json.dumps(a) == json.dumps(b)
    r = a["layers"][0]
    assert r["rel_l2"] == 0.00165937 and r["cosine"] == 0.999999 and r["cosines"] == {"0": 0.999999, "1": 0.967243}
    assert r["ref_rel_l2"] is None and r["gap_cosine"] is None
