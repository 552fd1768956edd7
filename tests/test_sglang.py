"""The ``sglang`` engine against SGLang 0.5.23's own code on CPU: SmolLM2 (N = 30, H = 576), tiny random Qwen3.

SGLang runs in its capture-only EAGLE-3 mode (see eaglepipe/engines/sglang.py); the reference is HF
transformers' ``output_hidden_states[k]`` = h[k] for k < N (pre-norm residual stream), one sequence at a time.
SGLang's id i is expected to be h[i+1] for llama/qwen3 ("output of layer i"): ids are passed to SGLang
untouched, so these tests measure SGLang's convention, they do not assume it.

Start-ups are the cost (20–60 s each on 2 cores): one SmolLM2 instance records every id 0..N-2 at once
(``capture_ids``), so all SmolLM2 captures, the validate_offsets runs and generation share it; the tiny Qwen3
starts one more.

Set ``EAGLEPIPE_FIGURES=path.json`` to keep the measured figures (start-up, tokens/s, cosine per layer).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest
import torch

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

if importlib.util.find_spec("sglang") is None:  # pragma: no cover — any other failure must show
    pytest.skip("sglang is not installed; scripts/setup.sh installs sglang==0.5.23 --no-deps + "
                "requirements-sglang.txt", allow_module_level=True)

from eaglepipe.contract import convention, validate  # noqa: E402
from eaglepipe.data.features import FeatureSample  # noqa: E402
from eaglepipe.engines.sglang import SGLangEngine, SGLangError, serve_eagle3  # noqa: E402

N = 30  # SmolLM2-135M decoder layers
ALL_IDS = list(range(N - 1))  # every id SGLang can capture for llama: id i = h[i+1], 0 ≤ i ≤ N-2
STORED = [3, 16, 28]  # the project's origin: features stored for boundaries h[3], h[16], h[28]
MIN_COS = 0.9999

FIGURES: dict = {}


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token cosine of two [T, H] float tensors, shape [T]."""
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def _hf_states(model, sequences: list[list[int]]) -> tuple[list[torch.Tensor], float]:
    """Per sequence HF ``output_hidden_states[k]`` for k < N stacked: float32 [T, N, H]; and tokens/s."""
    t0 = time.perf_counter()
    out = []
    with torch.inference_mode():
        for s in sequences:  # one at a time: no padding in the reference
            hs = model.model(input_ids=torch.tensor([s]), output_hidden_states=True).hidden_states
            n = len(hs) - 1
            out.append(torch.stack([hs[k][0].float() for k in range(n)], dim=1))  # shape: [T, N, H]
    return out, sum(map(len, sequences)) / (time.perf_counter() - t0)


def _dump_figures() -> None:
    if os.environ.get("EAGLEPIPE_FIGURES"):
        with open(os.environ["EAGLEPIPE_FIGURES"], "w") as f:
            json.dump(FIGURES, f, indent=2, default=str)


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def prompts(tok) -> list[list[int]]:
    """Two generation prompts (chat template + assistant header)."""
    qs = ["Name three primary colors.", "What is 12 times 7?"]
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)) for q in qs]


@pytest.fixture(scope="module")
def hf_states(hf, sequences) -> list[torch.Tensor]:
    """Per sequence h[0..N-1] from HF: [T, N, H]."""
    states, tps = _hf_states(hf, sequences)
    FIGURES["hf_forward_tokens_per_s"] = tps
    return states


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    e = SGLangEngine(smollm2_dir, max_total_tokens=2048, capture_ids=ALL_IDS)
    yield e
    e.close()
    FIGURES["startup_s"] = e.startup_s
    _dump_figures()


@pytest.fixture(scope="module")
def captured(engine, sequences) -> list[torch.Tensor]:
    """SGLang's capture of every id 0..N-2 (the instance starts here): per sequence [T, N-1, H]."""
    engine.capture(sequences[:1], [0])  # starts the instance; not timed
    t0 = time.perf_counter()
    out = engine.capture(sequences, ALL_IDS)
    FIGURES["capture_tokens_per_s"] = sum(map(len, sequences)) / (time.perf_counter() - t0)
    return out


def _write_draft_config(folder, nested_ids: list[int]):
    """A draft config.json holding only what SGLang reads for capture: the nested eagle_config ids."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {"eagle_aux_hidden_state_layer_ids": nested_ids}}
    ))
    return folder


# ------------------------------------------------------------------------------------------- SmolLM2


def test_capture_id_i_is_hf_h_i_plus_1(captured, hf_states):
    """Every id i SGLang can capture equals HF's h[i+1] (cosine ≥ 0.9999 on every token, fp32); and not h[i]."""
    per_layer = {}
    for j, i in enumerate(ALL_IDS):
        cos = torch.cat([_cos(c[:, j], h[:, i + 1]) for c, h in zip(captured, hf_states)])
        per_layer[i] = cos.min().item()
        assert per_layer[i] >= MIN_COS, f"id {i}: min cosine with h[{i + 1}] is {per_layer[i]:.6f}"
    FIGURES["cosine_min_id_i_vs_hf_h_i_plus_1"] = per_layer
    for j, i in enumerate([2, 15, 27]):  # the same ids read as vLLM would (h[i]) do not match
        cos = torch.cat([_cos(c[:, i], h[:, i]) for c, h in zip(captured, hf_states)]).mean().item()
        assert cos < 0.99, f"id {i} also matches h[{i}] (cosine {cos:.4f}); the test could not tell +1 apart"


def test_capture_returns_requested_ids_in_order(engine, captured, sequences):
    """A subset of the recorded ids comes back in the order asked, [T, len(ids), H] float32, without a restart."""
    started = dict(engine.startup_s)
    got = engine.capture(sequences, [2, 15, 27])
    assert engine.startup_s == started
    for g, c, s in zip(got, captured, sequences):
        assert g.shape == (len(s), 3, 576) and g.dtype == torch.float32
        torch.testing.assert_close(g, c[:, [2, 15, 27]])
    with pytest.raises(ValueError, match="ascending"):
        engine.capture(sequences, [15, 2])
    with pytest.raises(ValueError, match=r"\[0, 30\)"):
        engine.capture(sequences, [30])


def test_origin_vllm_ids_are_one_layer_deep_on_sglang(engine, captured, sequences, hf_states, tmp_path):
    """The project's origin. Features stored for h[3], h[16], h[28]; a draft whose config gives SGLang those
    boundaries in vLLM's meaning ([3, 16, 28]) is fed h[4], h[17], h[29] (+1); ids [2, 15, 27] match."""
    stored = [h[:, STORED] for h in hf_states]  # per sequence [T, 3, H]
    vllm_meaning = engine.capture_for_draft(sequences, _write_draft_config(tmp_path / "bad", STORED))
    sglang_meaning = engine.capture_for_draft(sequences, _write_draft_config(tmp_path / "good", [k - 1 for k in STORED]))
    for s, bad, good, h in zip(stored, vllm_meaning, sglang_meaning, hf_states):
        for j, k in enumerate(STORED):
            assert _cos(good[:, j], s[:, j]).min() >= MIN_COS, f"id {k - 1} should give stored h[{k}]"
            assert _cos(bad[:, j], h[:, k + 1]).min() >= MIN_COS, f"id {k} should give h[{k + 1}]"
            assert _cos(bad[:, j], s[:, j]).mean() < 0.99, f"id {k} unexpectedly matches stored h[{k}]"


def test_validate_offsets_says_plus_one_against_real_sglang(engine, captured, sequences, hf_states, monkeypatch):
    """validate_offsets (eaglepipe.contract.validate.check_offsets) run against SGLang: the correct export passes; an
    export written in vLLM's meaning (the translator bug behind the project) fails and says "+1"."""
    samples = [
        FeatureSample(id=f"s{j}", input_ids=torch.tensor(s), loss_mask=torch.ones(len(s), dtype=torch.bool),
                      aux=h[:, STORED], last=h[:, -1])
        for j, (s, h) in enumerate(zip(sequences, hf_states))
    ]
    ok = validate.check_offsets(engine, "llama", N, STORED, samples, search=1, min_cosine=MIN_COS)
    assert ok.ok, ok.message()
    assert [r.engine_id for r in ok.layers] == [2, 15, 27]

    monkeypatch.setattr(validate.convention, "engine_ids", lambda engine, family, b, n, version=None: list(b))
    bad = validate.check_offsets(engine, "llama", N, STORED, samples, search=1, min_cosine=MIN_COS)
    assert not bad.ok
    assert [r.best_offset for r in bad.layers] == [1, 1, 1]
    assert "off by +1" in bad.message()
    FIGURES["validate_offsets_plus_one_message"] = bad.message().splitlines()[0]


def test_generate_greedy_matches_hf(engine, captured, hf, prompts):
    """sglang.Engine greedy completions equal HF's (fp32), EOS included when produced."""
    t0 = time.perf_counter()
    got = engine.generate(prompts, max_new_tokens=16)
    FIGURES["generate_tokens_per_s"] = sum(map(len, got)) / (time.perf_counter() - t0)
    eos = hf.generation_config.eos_token_id
    for p, g in zip(prompts, got):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
        ref = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert g == ref


def test_serve_eagle3_needs_cuda(smollm2_dir, tmp_path, prompts):
    """EAGLE-3 serving is complete for CUDA; on CPU it refuses up front with the reason (nothing starts)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: run serve_eval with engine sglang (see README) instead of this CPU check")
    with pytest.raises(SGLangError, match="needs CUDA"):
        serve_eagle3(smollm2_dir, tmp_path, prompts, k=3, max_new_tokens=8)


# ------------------------------------------------------------------------------------------- other families


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    out = tmp_path_factory.mktemp("tiny_qwen3")
    Qwen3ForCausalLM(cfg).eval().save_pretrained(out)
    return out


def test_qwen3_rule_matches_real_capture(tiny_qwen3):
    """A random Qwen3 (N = 6): SGLang's capture for ids [0, 2, 4] is h[1], h[3], h[5], as convention says."""
    from transformers import AutoModelForCausalLM

    seqs = [list(range(3, 40)), list(range(50, 70))]
    ids = [0, 2, 4]
    ref, _ = _hf_states(AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval(), seqs)
    with SGLangEngine(tiny_qwen3, max_total_tokens=1024, engine_kwargs={"skip_tokenizer_init": True}) as e:
        got = e.capture(seqs, ids)
    expected = convention.boundaries_of("sglang", "qwen3", ids, 6)
    assert expected == [1, 3, 5]
    for g, h in zip(got, ref):
        for j, k in enumerate(expected):
            assert _cos(g[:, j], h[:, k]).min() >= MIN_COS, f"qwen3 id {ids[j]} is not h[{k}]"


def test_shim_assign_req_to_token_pool_cpu():
    """The one stand-in op: new KV slots land in each request's row at [start, end), batch order."""
    from eaglepipe.engines.sgl_kernel_cpu_shim import assign_req_to_token_pool_cpu

    table = torch.zeros(3, 6, dtype=torch.int32)
    assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), table, torch.tensor([1, 0]), torch.tensor([3, 2]), torch.tensor([10, 11, 20, 21]), 6,
    )
    assert table.tolist() == [[20, 21, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 10, 11, 0, 0, 0]]
