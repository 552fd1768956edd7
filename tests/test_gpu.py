"""Tests that need a CUDA GPU; on a machine without one (CI's) each is skipped and says why.

Run them on a CUDA machine with the engine installed, one engine's environment at a time (an engine's test is
skipped where it does not import): ``python -m pytest -q tests/test_gpu.py``. Engine options of that machine
(e.g. SGLang's ``attention_backend``) come through ``EAGLEPIPE_SGLANG_ARGS`` / ``EAGLEPIPE_VLLM_ARGS``, as for
the stages. What they hold:
  - rows of other lengths padded to one length by :func:`eaglepipe.train.ttt.pad_batch` do not compile the draft
    again unless their later steps' bucketed length (:func:`eaglepipe.train.ttt.flex_rows`) is new (one compile
    per new length would make each row recompile; tests/test_ttt.py compares the fast path on CUDA with the
    plain one);
  - the online capture on the device equals the CPU capture;
  - the tiny kimi_k2 target (DeepSeek-V3 MLA, top-2 routing) through vLLM and through SGLang on CUDA matches
    transformers fp32 at every boundary (issue 12's seeds' case; benchmarks/h200/offsets_sglang_deepseek.json).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False): the fast TTT path's flex_attention kernels, "
           "the online capture on the device and the CUDA builds of vLLM/SGLang run only there")


def _case(T: int, seed: int):
    """tests/test_ttt.py's packed row of three samples at length T, on CUDA."""
    from test_ttt import _packed_case

    from eaglepipe.model.target_head import SoftTargets

    b, soft = _packed_case(T, seed=seed)
    return b.to("cuda"), SoftTargets(p=soft.p.cuda(), top=soft.top.cuda(), top_in_vocab=soft.top_in_vocab.cuda())


def _draft(head_dim: int = 16):
    from eaglepipe.model.draft import DraftConfig, Eagle3Draft

    torch.manual_seed(0)
    return Eagle3Draft(DraftConfig(32, 32 // head_dim, 1, head_dim, 64, 1e-6, 10000.0, 4096, 32, 3, 8, 99)).cuda()


@pytest.mark.parametrize("head_dim", [16, 8])  # 16: flex_attention; 8: below its kernel's minimum, plain attention
def test_rows_padded_to_one_length_compile_the_draft_once(head_dim):
    """Rows of four lengths padded to one: a row compiles nothing new unless its later steps' query length (flex:
    flex_rows' bucket of its chain rows; plain attention: every position) is new. 903 and 950 share a bucket."""
    from torch._dynamo.utils import counters

    from eaglepipe.train.ttt import (
        chain_rows,
        compile_draft,
        counted_trained,
        flex_rows,
        pad_batch,
        padded_length,
        ttt_unroll,
        uses_flex,
    )

    draft, embed = _draft(head_dim), torch.randn(99, 32, device="cuda")
    assert uses_flex(head_dim, "cuda") == (head_dim >= 16)
    compile_draft(draft)
    T = padded_length(1000)  # 1024
    seen, graphs = set(), []
    for n in (1000, 700, 903, 950):  # row lengths, as an epoch's packed rows have
        b, soft = _case(n, seed=n)
        pb = pad_batch(b, T)
        pad = lambda x, fill: torch.cat([x, x.new_full((1, T - n, *x.shape[2:]), fill)], 1)  # noqa: E731
        psoft = type(soft)(p=pad(soft.p, 1 / 8), top=pad(soft.top, 0), top_in_vocab=pad(soft.top_in_vocab, False))
        rows = flex_rows(chain_rows([counted_trained(pb, psoft, j)[1] for j in range(3)]), T)
        N = len(rows[1]) if uses_flex(head_dim, "cuda") else T
        r = ttt_unroll(draft, embed, pb, psoft, steps=3, decay=0.8, fast=True)
        r.loss.backward()
        graphs.append(counters["stats"]["unique_graphs"])
        assert N not in seen or graphs[-1] == graphs[-2], f"compiled graphs after each row: {graphs}, N = {N}"
        seen.add(N)
    assert len(seen) < 4  # a length came back


def test_online_capture_on_the_device_equals_the_cpu_capture(tiny_target):
    from eaglepipe.engines.hf import HFEngine

    seqs = [[1, 5, 7, 9, 11, 13, 17], [1, 4, 4, 8], list(range(3, 60))]
    cpu = HFEngine(tiny_target, device="cpu").capture(seqs, [0, 2, 4])
    for compile in (False, True):  # eager (training's) and compiled (benchmarks/online_train.py's A/B)
        gpu = HFEngine(tiny_target, device="cuda", compile=compile).capture(seqs, [0, 2, 4], on_device=True,
                                                                           token_budget=128)
        for c, g in zip(cpu, gpu):
            assert g.is_cuda
            torch.testing.assert_close(g.cpu(), c, rtol=1e-4, atol=1e-4)  # fp32; CUDA matmuls, other padding


def _crosscheck(engine_name: str, target, bounds: list[int], **engine_opts) -> list[dict]:
    """``target`` through hf fp32 (the reference) and ``engine_name`` in bf16 at ``bounds`` (ids in the engine's
    meaning, eaglepipe.contract.convention) on 4 chat-templated conversations: per boundary the gate's cosine
    and relative L2 (eaglepipe.contract.validate.cosine_rel_l2)."""
    from transformers import AutoTokenizer

    from eaglepipe.contract import convention
    from eaglepipe.contract.validate import cosine_rel_l2
    from eaglepipe.engines import get_engine
    from eaglepipe.engines.hf import HFEngine
    from eaglepipe.target.info import read_info
    from eaglepipe.target.tiny import tiny_conversations

    info = read_info(target, hash_weights=False)
    tok = AutoTokenizer.from_pretrained(target)
    seqs = [tok(tok.apply_chat_template(c["messages"][:1], tokenize=False))["input_ids"]
            for c in tiny_conversations(4, answer_words=5)]
    ref = torch.cat(HFEngine(target, dtype="float32").capture(seqs, bounds))  # (ΣT, B, H)
    with get_engine(engine_name, target, dtype="bfloat16", info=info, **engine_opts) as e:
        got = torch.cat(e.capture(seqs, convention.ids_reading_as(engine_name, info.family, bounds, info.n_layers)))
    rows = []
    for j, k in enumerate(bounds):
        cos, rel = cosine_rel_l2(ref[:, j], got[:, j])
        rows.append({"boundary": k, "cosine": cos, "rel_l2": rel})
    return rows


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_tiny_kimi_through_the_cuda_engine_matches_transformers(engine, tmp_path):
    """Issue 12 item 5's target through the real engine in bf16 against transformers fp32 at every boundary
    the engine captures from h[2] on. Engine options (SGLang's attention backend where its default kernels are
    not installed) come from the environment (EAGLEPIPE_SGLANG_ARGS, EAGLEPIPE_VLLM_ARGS)."""
    pytest.importorskip(engine, reason=f"{engine} is not importable here")
    from eaglepipe.contract import convention
    from eaglepipe.target.info import materialize_target, read_info
    from eaglepipe.target.tiny import build

    target = tmp_path / "target"
    materialize_target(str(build("kimi_k2", tmp_path / "src")), target)
    info = read_info(target, hash_weights=False)
    bounds = sorted(set(range(2, info.n_layers)) & set(convention.capturable(engine, info.family, info.n_layers)))
    rows = _crosscheck(engine, target, bounds, **({"max_total_tokens": 2048} if engine == "sglang" else {}))
    assert [r["boundary"] for r in rows] == bounds and len(bounds) >= 3
    for r in rows:
        assert r["cosine"] >= 0.999, r
