"""Served-τ arithmetic shared by the engines: batch groups, per-batch-size results, SGLang's own counters."""

import importlib.util

import pytest

from eaglepipe.engines.serve import by_batch_size, groups, spec_acceptance


def test_groups_split_in_order():
    assert groups([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert groups([1, 2, 3], None) == [[1, 2, 3]]
    assert groups([1, 2, 3], 1) == [[1], [2], [3]]
    with pytest.raises(ValueError, match="batch size"):
        groups([1], 0)


def test_by_batch_size_keeps_first_and_all_equal():
    a = {"tau": 1.5, "speedup": 1.2, "outputs_equal": True, "tokens_per_s_draft": 12.0, "other": 1}
    b = {"tau": 1.4, "speedup": 1.1, "outputs_equal": False, "tokens_per_s_draft": 30.0, "other": 2}
    out = by_batch_size([a, b], (1, 8))
    assert out["tau"] == 1.5 and out["other"] == 1
    assert out["by_batch_size"] == {"1": {"tau": 1.5, "speedup": 1.2, "outputs_equal": True, "tokens_per_s_draft": 12.0},
                                    "8": {"tau": 1.4, "speedup": 1.1, "outputs_equal": False, "tokens_per_s_draft": 30.0}}
    assert out["outputs_equal"] is False  # one batch size differed
    assert "by_batch_size" not in by_batch_size([a], (None,))


def test_compact_metrics_carry_the_speedup_at_each_batch_size():
    """serve.batch_sizes [1, 8]: dvc metrics get speedup_bs1 / speedup_bs8 beside the first run's figures."""
    from eaglepipe.serving.evaluate import compact_serve_metrics

    run = lambda tau, speedup: {"tau": tau, "acceptance_per_pos": [tau - 1, 0.0], "tokens_per_s_draft": 10.0,  # noqa: E731
                                "tokens_per_s_plain": 10.0 / speedup, "speedup": speedup, "outputs_equal": True}
    served = by_batch_size([run(1.5, 0.8), run(1.5, 0.85)], (1, 8))
    m = compact_serve_metrics({"k": 2, "gate": {"verdict": "ok"}, "vllm": served, "reference": run(1.5, 0.9)})
    assert m["vllm"]["speedup"] == 0.8 and (m["vllm"]["speedup_bs1"], m["vllm"]["speedup_bs8"]) == (0.8, 0.85)
    assert "speedup_bs1" not in m["reference"] and m["gate"] == "ok"


def test_sglang_counters_give_reference_definitions():
    # two requests, k = 3. Request 1: 4 verify steps accepting 0, 1, 3, 3 drafts; request 2: 2 steps, 2 and 0.
    meta = [
        {"spec_verify_ct": 4, "spec_num_correct_drafts": 7, "spec_num_proposed_drafts": 12, "completion_tokens": 12,
         "spec_correct_drafts_histogram": [1, 1, 0, 2]},
        {"spec_verify_ct": 2, "spec_num_correct_drafts": 2, "spec_num_proposed_drafts": 6, "completion_tokens": 5,
         "spec_accept_histogram": [1, 0, 1]},  # the older alias, a shorter list
    ]
    r = spec_acceptance(meta, 3)
    assert r["tau"] == pytest.approx(1 + 9 / 6)  # tokens per target forward, prefill not counted
    assert r["tau_sglang_accept_length"] == pytest.approx(17 / 6)  # SGLang's own (counts the prefill token)
    # steps accepting ≥1: 1+0+2 + 0+1 = 4 of 6; ≥2: 2+1 = 3; ≥3: 2
    assert r["acceptance_per_pos"] == pytest.approx([4 / 6, 3 / 6, 2 / 6])
    assert r["accept_rate"] == pytest.approx(9 / 18) and r["verify_steps"] == 6 and r["histogram_steps"] == 6
    # τ = 1 + Σ acceptance per position when every step is in the histogram
    assert r["tau"] == pytest.approx(1 + sum(r["acceptance_per_pos"]))


def test_sglang_probe_draft_makes_sglang_read_the_ids(tmp_path):
    """The probe draft for SGLang without a capture-only mode: the ids SGLang reads, an fc that takes them."""
    import json

    from safetensors import safe_open

    from eaglepipe.contract import draft_config
    from eaglepipe.engines.sglang_probe import (
        capture_server_args,
        has_capture_only_mode,
        probe_draft,
    )
    from eaglepipe.target.tiny import build

    target = build("llama", tmp_path / "t")
    cfg = json.loads((target / "config.json").read_text())
    h = cfg["hidden_size"]
    out = probe_draft(target, [1, 3, 4, 5], tmp_path / "w")
    dcfg = json.loads((out / "config.json").read_text())
    assert draft_config.config_ids(dcfg, "sglang") == ([1, 3, 4, 5], draft_config.NESTED_FIELD)
    assert dcfg["num_aux_hidden_states"] == 4 and dcfg["architectures"] == ["LlamaForCausalLMEagle3"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert tuple(f.get_slice("fc.weight").get_shape()) == (h, 4 * h)
        assert tuple(f.get_slice("lm_head.weight").get_shape()) == (cfg["vocab_size"], h)
    assert probe_draft(target, [1, 3, 4, 5], tmp_path / "w") == out  # written once per (target, ids)
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("the capture-only mode is read from the installed SGLang's sources (scripts/setup.sh installs it)")
    # the installed SGLang (0.5.23) has the capture-only mode: no probe is used there
    assert has_capture_only_mode()
    assert capture_server_args(target, [2], tmp_path / "w", "float32")["return_aux_hidden_state_layer_ids"] == [2]
