"""TTT: the mask as literal tables, the efficient attention against the dense mask, the alignment on a
hand-built example, teacher forcing with the draft's own hidden state, the loss/accuracy rules, soft targets."""

import json

import pytest
import torch
import torch.nn.functional as F

from eaglepipe.model.draft import DraftConfig, Eagle3Draft, repeat_kv
from eaglepipe.model.target_head import SoftTargets, load_target_head, soft_targets
from eaglepipe.train.ttt import Batch, TTTAttention, align_step, tau_sim, ttt_mask, ttt_unroll

torch.set_num_threads(1)


def test_mask_table_one_sample():
    m = ttt_mask(torch.zeros(4, dtype=torch.long), step=2).int().tolist()
    assert m == [
        # step 0    | step 1    | step 2
        [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1],
    ]


def test_mask_table_two_packed_samples():
    m = ttt_mask(torch.tensor([0, 0, 1, 1]), step=1).int().tolist()
    assert m == [
        [1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],
        [0, 0, 1, 0, 0, 0, 1, 0],
        [0, 0, 1, 1, 0, 0, 0, 1],
    ]


def test_ttt_attention_equals_dense_masked_attention():
    torch.manual_seed(0)
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    att = TTTAttention(doc[None])
    ks, vs = [], []
    for step in range(3):
        q, k, v = torch.randn(1, 4, 7, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
        ks.append(k)
        vs.append(v)
        got = att.attend(q, k, v)
        K = repeat_kv(torch.cat(ks, 2), 2)  # (1, 4, 7·(step+1), 8)
        V = repeat_kv(torch.cat(vs, 2), 2)
        want = F.scaled_dot_product_attention(q, K, V, attn_mask=ttt_mask(doc, step))
        torch.testing.assert_close(got, want)


def _soft(T, Vd, top_in_vocab=None):
    """Soft targets whose argmax at position s is draft id s (so a shift shows which position was read)."""
    p = torch.full((1, T, Vd), 0.1 / (Vd - 1))
    p[0, torch.arange(T), torch.arange(T)] = 0.9
    tiv = torch.ones(1, T, dtype=torch.bool) if top_in_vocab is None else torch.tensor([top_in_vocab], dtype=torch.bool)
    return SoftTargets(p=p, top=torch.arange(T)[None], top_in_vocab=tiv)


def _batch(ids, doc, mask, pos=None):
    T = len(ids)
    pos = pos if pos is not None else list(range(T))
    return Batch(torch.tensor([ids]), torch.tensor([pos]), torch.tensor([doc]), torch.tensor([mask], dtype=torch.bool),
                 torch.zeros(1, T, 3, 32), torch.zeros(1, T, 32))


def test_alignment_by_hand():
    # ids x0..x5 = 10..15; loss_mask[t] = x_{t+1} is assistant: x2..x5 are (mask 0 1 1 1 1 0)
    b = _batch([10, 11, 12, 13, 14, 15], [0] * 6, [0, 1, 1, 1, 1, 0])
    s0 = align_step(b, _soft(6, 8), 0)  # (g_t, x_{t+1}) → x_{t+2} ~ p_{t+1}
    assert s0.ids.tolist() == [[11, 12, 13, 14, 15, 0]]
    assert s0.top.tolist() == [[1, 2, 3, 4, 5, 0]]  # reads p_{t+1}
    assert s0.positions.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert s0.counted.int().tolist() == [[1, 1, 1, 1, 0, 0]]  # x2..x5 predicted at t=0..3
    s2 = align_step(b, _soft(6, 8), 2)  # (d¹_t, x_{t+3}) → x_{t+4} ~ p_{t+3}
    assert s2.ids.tolist() == [[13, 14, 15, 0, 0, 0]]
    assert s2.top.tolist() == [[3, 4, 5, 0, 0, 0]]
    assert s2.positions.tolist() == [[2, 3, 4, 5, 6, 7]]
    assert s2.counted.int().tolist() == [[1, 1, 0, 0, 0, 0]]  # x4, x5 predicted at t=0, 1


def test_alignment_never_crosses_packed_samples():
    b = _batch([10, 11, 12, 20, 21, 22], [0, 0, 0, 1, 1, 1], [1, 1, 0, 1, 1, 0], pos=[0, 1, 2, 0, 1, 2])
    s0 = align_step(b, _soft(6, 8, [1, 1, 1, 1, 0, 1]), 0)
    assert s0.counted.int().tolist() == [[1, 0, 0, 1, 0, 0]]
    assert s0.trained.int().tolist() == [[1, 0, 0, 0, 0, 0]]  # p_4's top-1 is outside the draft vocab
    s1 = align_step(b, _soft(6, 8), 1)
    assert s1.counted.int().tolist() == [[0, 0, 0, 0, 0, 0]]  # x_{t+3} is never both assistant and in-sample
    b.loss_mask[:] = True
    s1 = align_step(b, _soft(6, 8), 1)
    assert s1.counted.int().tolist() == [[1, 0, 0, 1, 0, 0]]  # t=1,2 would read the next sample's tokens
    assert s1.positions.tolist() == [[1, 2, 3, 1, 2, 3]]


@pytest.fixture
def draft():
    torch.manual_seed(0)
    # head_dim 16: flex_attention's CUDA kernel needs >= 16 (ttt.uses_flex), so the CUDA case runs flex
    cfg = DraftConfig(32, 2, 1, 16, 64, 1e-6, 10000.0, 256, 32, 3, 8, 99)
    return Eagle3Draft(cfg)


def test_own_hidden_fed_back_and_tokens_teacher_forced(draft):
    embed = torch.randn(99, 32)
    b = _batch([10, 11, 12, 13, 14, 15], [0] * 6, [0, 1, 1, 1, 1, 0])
    b.aux = torch.randn(1, 6, 3, 32)
    calls = []
    layer = draft.layer

    def spy(emb, hidden, positions, attend):
        out = layer(emb, hidden, positions, attend)
        calls.append((emb, hidden, positions, out))
        return out

    draft.layer = spy
    ttt_unroll(draft, embed, b, _soft(6, 8), steps=3, decay=0.8)
    assert len(calls) == 3
    torch.testing.assert_close(calls[0][1], draft.project(b.aux))  # step 0 reads fc(g), at every position
    # step 1 trains t = 0, 1, 2 (x_{t+2} assistant text), step 2 t = 0, 1: later steps run only there
    rows = {0: list(range(6)), 1: [0, 1, 2], 2: [0, 1]}
    for j in (1, 2):
        r, prev = rows[j], rows[j - 1]
        at = [prev.index(t) for t in r]
        assert torch.equal(calls[j][1], calls[j - 1][3][:, at])  # step j-1's pre-norm output at the same t
        assert calls[j][1].grad_fn is not None  # ... with its graph
        ids = torch.tensor([[10, 11, 12, 13, 14, 15][1 + j :] + [0] * (1 + j)])[:, r]
        torch.testing.assert_close(calls[j][0], embed[ids])  # data tokens x_{t+1+j}, not the argmax
        assert calls[j][2].tolist() == [[t + j for t in r]]


def test_loss_and_accuracy_rules(draft):
    embed = torch.randn(99, 32)
    b = _batch([10, 11, 12, 20, 21, 22], [0, 0, 0, 1, 1, 1], [1, 1, 0, 1, 1, 0], pos=[0, 1, 2, 0, 1, 2])
    b.aux = torch.randn(1, 6, 3, 32)
    soft = _soft(6, 8, [1, 1, 1, 1, 0, 1])
    r = ttt_unroll(draft, embed, b, soft, steps=2, decay=0.5)
    # recompute step 0 by hand: counted t ∈ {0, 3}, trained t ∈ {0} (p_4's top-1 is out of vocabulary)
    from eaglepipe.train.ttt import TTTAttention as A

    out = draft.layer(embed[torch.tensor([[11, 12, 20, 21, 22, 0]])], draft.project(b.aux), b.positions, A(b.doc).attend)
    logp = torch.log_softmax(draft.logits(out), -1)[0]
    ce0 = -(soft.p[0, 1] * logp[0]).sum()
    torch.testing.assert_close(r.step_loss[0], ce0.detach())
    assert r.counted.tolist() == [2, 0] and r.trained.tolist() == [1, 0]  # step 1: none (see above)
    assert r.correct[0] == int(logp[0].argmax() == 1)  # t=3 can never be correct: its top-1 is unreachable
    torch.testing.assert_close(r.loss, r.step_loss[0] + 0.5 * r.step_loss[1], check_dtype=False)


def test_tau_sim():
    assert tau_sim([0.8, 0.5, 0.25]) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert tau_sim([1.0, 1.0, 1.0]) == 4.0 and tau_sim([0.0, 1.0]) == 1.0


def test_soft_targets_match_the_hf_target(tiny_target):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_target).eval()
    ids = torch.randint(0, 99, (1, 9))
    captured = {}
    model.model.norm.register_forward_hook(lambda m, i, o: captured.update(last=i[0]))
    with torch.no_grad():
        logits = model(ids).logits  # (1, 9, 99)
    head = load_target_head(tiny_target)
    assert head.tied and head.vocab_size == 99
    torch.testing.assert_close(head.logits(captured["last"]), logits, rtol=1e-5, atol=1e-5)
    t2d = torch.zeros(99, dtype=torch.bool)
    t2d[::2] = True  # even ids form the draft vocabulary
    st = soft_targets(head, captured["last"], t2d, chunk=4)
    torch.testing.assert_close(st.p, torch.softmax(logits[..., ::2], -1), rtol=1e-5, atol=1e-6)
    assert st.top_in_vocab.tolist() == (logits.argmax(-1) % 2 == 0).tolist()
    fast = soft_targets(head, captured["last"], t2d, top_in_vocab=st.top_in_vocab)  # only the draft rows
    torch.testing.assert_close(fast.p, st.p)
    assert fast.top.tolist() == st.top.tolist()
    json.dumps(st.top.tolist())  # plain ints
    need = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0]], dtype=torch.bool)  # the positions the loss reads
    for tiv in (None, st.top_in_vocab):
        part = soft_targets(head, captured["last"], t2d, top_in_vocab=tiv, chunk=2, need=need)
        torch.testing.assert_close(part.p[need], st.p[need], rtol=1e-5, atol=1e-6)
        assert not part.p[~need].any() and part.top[~need].eq(0).all()
        want_tiv = st.top_in_vocab & need if tiv is None else st.top_in_vocab  # computed here: False where not needed
        assert part.top_in_vocab.tolist() == want_tiv.tolist() and part.top[need].tolist() == st.top[need].tolist()


@pytest.mark.parametrize("norm_output", [False, True])
def test_ttt_steps_equal_the_serving_chain(draft, norm_output):
    """Step j at position t of the unroll == the j-th draft forward of a KV-cache decoder that accepted x_0..x_{t+1}
    and drafts with teacher-forced tokens: same keys visible, same RoPE positions, same fed-back hidden state
    (EAGLE-3.1's norm_output: the normed one, in both)."""
    from eaglepipe.model.draft import KVCache, draft_step

    draft.cfg.norm_output = norm_output
    torch.manual_seed(3)
    embed = torch.randn(99, 32)
    ids = [5, 17, 42, 8, 63, 21, 90, 11]
    b = _batch(ids, [0] * 8, [1] * 8)
    b.aux = torch.randn(1, 8, 3, 32)
    att, hidden, outs = TTTAttention(b.doc), draft.project(b.aux), []
    for j in range(3):
        s = align_step(b, _soft(8, 8), j)
        hidden = draft.feed(draft.layer(embed[s.ids], hidden, s.positions, att.attend))
        outs.append(hidden)
    x = torch.tensor([ids])
    for t in (0, 2, 4):
        cache = KVCache()  # extend: (g_s, x_{s+1}) at positions s = 0..t
        r = draft_step(draft, embed, x[:, 1 : t + 2], torch.arange(t + 1)[None], cache, aux=b.aux[:, : t + 1])
        h = r.hidden[:, -1:]
        torch.testing.assert_close(h[0, 0], outs[0][0, t])
        for j in (1, 2):  # drafted token j reads x_{t+1+j} at position t+j
            r = draft_step(draft, embed, x[:, t + 1 + j : t + 2 + j], torch.tensor([[t + j]]), cache, hidden=h)
            h = r.hidden
            torch.testing.assert_close(h[0, 0], outs[j][0, t])


def _packed_case(T=37, Vd=8, seed=0, device="cpu"):
    """A packed row of three samples with a loss mask, peaked random soft targets and some OOV top-1s (on device)."""
    g = torch.Generator().manual_seed(seed)
    lens = [14, 9, T - 23]
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lens)])[None]  # (1, T)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    b = Batch(torch.randint(0, 99, (1, T), generator=g), pos, doc, torch.rand(1, T, generator=g) > 0.2,
              torch.randn(1, T, 3, 32, generator=g), torch.zeros(1, T, 32))
    p = torch.softmax(3 * torch.randn(1, T, Vd, generator=g), -1)
    soft = SoftTargets(p=p, top=p.argmax(-1), top_in_vocab=torch.rand(1, T, generator=g) > 0.1)
    return b.to(device), SoftTargets(p=soft.p.to(device), top=soft.top.to(device),
                                     top_in_vocab=soft.top_in_vocab.to(device))


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: "
                    "there the fast path runs flex_attention (compiled) over rows padded to a multiple of its block"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_fast_path_equals_the_plain_path(draft, steps, device):
    """Same loss, per-step counts and gradients (fp32) for the fast implementation of the step."""
    draft = draft.to(device)
    embed = torch.randn(99, 32, device=device)
    b, soft = _packed_case(device=device)
    results, grads = [], []
    for fast in (False, True):
        draft.zero_grad(set_to_none=True)
        r = ttt_unroll(draft, embed, b, soft, steps=steps, decay=0.8, fast=fast)
        r.loss.backward()
        results.append(r)
        grads.append({k: v.grad.clone() for k, v in draft.named_parameters()})
    plain, fast = results
    tol = {"rtol": 1e-5, "atol": 1e-6} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-5}  # CUDA: other kernels
    torch.testing.assert_close(fast.loss, plain.loss, **tol)
    torch.testing.assert_close(fast.step_loss, plain.step_loss, **tol)
    for f in ("correct", "counted", "trained"):
        assert getattr(fast, f).tolist() == getattr(plain, f).tolist(), f
    assert plain.counted[0] > 0 and plain.trained[-1] > 0
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=10 * tol["rtol"], atol=tol["atol"], msg=k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA graphs (compile mode "
                    "reduce-overhead, benchmarks/train_step.py's -cg rows) exist only there")
def test_cuda_graph_replays_of_the_compiled_draft_give_the_plain_loss_and_gradients(draft):
    """compile_draft(mode="reduce-overhead"): the recording step and two replays each give the plain path's loss and
    gradients, so the benchmark's -cg rows time the same computation."""
    import copy

    from eaglepipe.train.ttt import compile_draft

    plain, cg = draft.cuda(), copy.deepcopy(draft).cuda()
    compile_draft(cg, mode="reduce-overhead")
    embed = torch.randn(99, 32, device="cuda")
    b, soft = _packed_case(device="cuda")
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        out = []
        for d, fast in ((plain, False), (cg, True)):
            d.zero_grad(set_to_none=True)
            r = ttt_unroll(d, embed, b, soft, steps=3, decay=0.8, fast=fast)
            r.loss.backward()
            out.append((r.loss.detach().clone(), {k: v.grad.clone() for k, v in d.named_parameters()}))
        (loss0, g0), (loss1, g1) = out
        torch.testing.assert_close(loss1, loss0, rtol=1e-4, atol=1e-5)
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-3, atol=1e-5, msg=k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: compile_draft compiles only there")
def test_evaluation_with_autograd_on_reuses_the_training_graphs(draft):
    """eaglepipe.train.evaluation.evaluate's reason to keep autograd on under train.fast: a forward with grad on
    after a training step compiles nothing new, one under no_grad compiles its own graphs (dynamo guards on the
    grad mode)."""
    from eaglepipe.train.curves import compile_stats
    from eaglepipe.train.ttt import compile_draft

    torch._dynamo.reset()
    d = draft.cuda()
    compile_draft(d)
    embed = torch.randn(99, 32, device="cuda")
    b, soft = _packed_case(device="cuda")
    ttt_unroll(d, embed, b, soft, steps=3, decay=0.8, fast=True).loss.backward()
    trained = compile_stats()[0]
    assert trained > 0
    with torch.enable_grad():
        ttt_unroll(d, embed, b, soft, steps=3, decay=0.8, fast=True)
    assert compile_stats()[0] == trained
    with torch.no_grad():
        ttt_unroll(d, embed, b, soft, steps=3, decay=0.8, fast=True)
    assert compile_stats()[0] > trained


def _prompt_reply(b: Batch, frac: float = 2 / 3) -> Batch:
    """b with each sample's first ``frac`` of positions prompt (loss_mask False), as real rows are."""
    n = torch.bincount(b.doc[0])[b.doc]  # (1, T) length of each position's sample
    b.loss_mask = (b.positions >= frac * n) & b.loss_mask
    return b


def _layer_lengths(draft):
    """Spy on draft.layer: the list of its calls' query lengths."""
    lengths, layer = [], draft.layer

    def spy(emb, hidden, positions, attend):
        lengths.append(emb.shape[1])
        return layer(emb, hidden, positions, attend)

    draft.layer = spy
    return lengths


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("steps", [2, 3, 5])
def test_later_steps_run_only_where_the_loss_reads_them(draft, steps, fast):
    """The unroll of one row (B = 1) computes steps ≥ 1 at chain_rows only; the same row twice (B = 2: every
    position, the mean over both equals one row's) gives the same loss, counts and gradients."""
    from eaglepipe.train.ttt import chain_rows

    embed = torch.randn(99, 32)
    b, soft = _packed_case()
    b.loss_mask = (b.positions >= torch.tensor([8, 5, 8])[b.doc]) & b.loss_mask  # a prompt, then the answer
    rows = chain_rows([align_step(b, soft, j).trained for j in range(steps)])
    assert rows[0] is None and 0 < len(rows[-1]) < 37 // 2 and len(rows[-1]) <= len(rows[1]) < 37  # prompts drop out
    assert all(set(rows[j + 1].tolist()) <= set(rows[j].tolist()) for j in range(1, steps - 1))
    two = Batch(**{k: None if v is None else torch.cat([v, v]) for k, v in vars(b).items()})
    soft2 = SoftTargets(p=torch.cat([soft.p, soft.p]), top=torch.cat([soft.top, soft.top]),
                        top_in_vocab=torch.cat([soft.top_in_vocab, soft.top_in_vocab]))
    lengths = _layer_lengths(draft)
    results, grads = [], []
    for bb, ss in ((b, soft), (two, soft2)):
        draft.zero_grad(set_to_none=True)
        r = ttt_unroll(draft, embed, bb, ss, steps=steps, decay=0.8, fast=fast)
        r.loss.backward()
        results.append(r)
        grads.append({k: v.grad.clone() for k, v in draft.named_parameters()})
    assert lengths == [37] + [len(r) for r in rows[1:]] + [37] * steps
    one, full = results
    torch.testing.assert_close(one.loss, full.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one.step_loss, full.step_loss, rtol=1e-5, atol=1e-6)
    for f in ("correct", "counted", "trained"):
        assert [2 * x for x in getattr(one, f).tolist()] == getattr(full, f).tolist(), f
    assert one.trained[-1] > 0
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("T", [37, 700])
def test_flex_fast_path_forward_equals_the_plain_path(draft, T, monkeypatch):
    """The fast path as it runs on CUDA (flex attention, the row padded to BLOCK, steps ≥ 1 at flex_rows' padded
    chain rows), forced on the CPU: eager flex_attention, forward only (no CPU backward). Same loss and counts
    as the plain path; the layer runs at the padded lengths."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from eaglepipe.train import ttt

    monkeypatch.setattr("eaglepipe.train.ttt.unroll.uses_flex", lambda head_dim, device: True)
    embed = torch.randn(99, 32)
    b, soft = _packed_case(T)
    b = _prompt_reply(b)
    Tp = ttt.padded_length(T)
    exact = ttt.chain_rows([align_step(b, soft, j).trained for j in range(3)])
    rows = ttt.flex_rows(exact, Tp)
    N = len(rows[1])
    assert N % ttt.BLOCK == 0 and rows[1].eq(Tp).sum() == N - len(exact[1]) > 0  # padding at the end
    assert torch.equal(rows[2][: len(exact[2])], exact[2])
    lengths = _layer_lengths(draft)
    with torch.no_grad():
        fast = ttt_unroll(draft, embed, b, soft, steps=3, decay=0.8, fast=True)
        plain = ttt_unroll(draft, embed, b, soft, steps=3, decay=0.8)
    assert lengths == [Tp, N, N, T, len(exact[1]), len(exact[2])]
    torch.testing.assert_close(fast.loss, plain.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast.step_loss, plain.step_loss, rtol=1e-5, atol=1e-6)
    for f in ("correct", "counted", "trained"):
        assert getattr(fast, f).tolist() == getattr(plain, f).tolist(), f
    assert plain.trained[-1] > 0


@pytest.mark.parametrize("fast", [False, True])
def test_padding_a_row_to_one_length_changes_nothing(draft, fast):
    """pad_batch (the fast path's one row shape on CUDA): same loss, counts and gradients as the unpadded row."""
    from eaglepipe.train.ttt import PAD_DOC, pad_batch, padded_length

    embed = torch.randn(99, 32)
    b, soft = _packed_case()
    pb = pad_batch(b, 64)
    assert pb.input_ids.shape == (1, 64) and pb.doc[0, 37:].eq(PAD_DOC).all() and not pb.loss_mask[0, 37:].any()
    assert pad_batch(b, 37) is b and padded_length(16384) == 16384 and padded_length(1000) == 1024
    with pytest.raises(ValueError, match="longer than 36"):
        pad_batch(b, 36)
    psoft = SoftTargets(p=torch.cat([soft.p, torch.full((1, 27, 8), 1 / 8)], 1),
                        top=torch.cat([soft.top, torch.zeros(1, 27, dtype=torch.long)], 1),
                        top_in_vocab=torch.cat([soft.top_in_vocab, torch.zeros(1, 27, dtype=torch.bool)], 1))
    results, grads = [], []
    for batch, st in ((b, soft), (pb, psoft)):
        draft.zero_grad(set_to_none=True)
        r = ttt_unroll(draft, embed, batch, st, steps=3, decay=0.8, fast=fast)
        r.loss.backward()
        results.append(r)
        grads.append({k: v.grad.clone() for k, v in draft.named_parameters()})
    plain, padded = results
    torch.testing.assert_close(padded.loss, plain.loss, rtol=1e-5, atol=1e-6)
    for f in ("correct", "counted", "trained"):
        assert getattr(padded, f).tolist() == getattr(plain, f).tolist(), f
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-4, atol=1e-6, msg=k)


def test_soft_ce_chunks_equal_one_product():
    from eaglepipe.train.ttt import soft_ce

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 11, 16, generator=g, requires_grad=True)
    W = torch.randn(24, 16, generator=g, requires_grad=True)
    p = torch.softmax(torch.randn(2, 11, 24, generator=g), -1)
    w = (torch.rand(2, 11, generator=g) > 0.3).float()
    loss, arg = soft_ce(x, W, p, w, chunk=4)
    z = x @ W.T
    want = (-(p * torch.log_softmax(z, -1)).sum(-1) * w).sum()
    torch.testing.assert_close(loss, want)
    assert arg.tolist() == torch.where(w > 0, z.argmax(-1), 0).tolist()  # rows of weight 0 are not multiplied
    gx, gW = torch.autograd.grad(2.5 * loss, (x, W))
    wx, wW = torch.autograd.grad(2.5 * want, (x, W))
    torch.testing.assert_close(gx, wx)
    torch.testing.assert_close(gW, wW)
    with torch.no_grad():
        assert soft_ce(x, W, p, w, chunk=5)[0].item() == pytest.approx(want.item(), rel=1e-6)


def test_flex_attention_equals_dense_masked_attention():
    """The flex mask (over [step 0 | … | step j] keys, block-sparse, extended by one diagonal per step) against
    the dense TTT mask; forward only (flex_attention has no CPU backward; the GPU benchmark checks gradients)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from eaglepipe.train.ttt import BLOCK, FlexTTTAttention

    torch.manual_seed(0)
    T = 2 * BLOCK
    doc = torch.cat([torch.zeros(100), torch.ones(120), torch.full((T - 220,), 2)]).long()
    att = FlexTTTAttention(doc[None])
    ks, vs = [], []
    for step in range(3):
        q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
        ks.append(k)
        vs.append(v)
        got = att.attend(q, k, v)
        K, V = repeat_kv(torch.cat(ks, 2), 2), repeat_kv(torch.cat(vs, 2), 2)
        want = F.scaled_dot_product_attention(q, K, V, attn_mask=ttt_mask(doc, step))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_flex_masks_at_fixed_addresses_give_the_same_attention(monkeypatch):
    """FlexTTTAttention with buffers (compile_draft under CUDA graphs): two batches of different samples through
    three TTT steps each attend as without buffers, and the mask_mod's tensors and the block tables stay at the
    addresses the first batch gave them, one set per (TTT step, tensor) and none shared between steps (a step's
    backward reads them)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import flex_attention

    from eaglepipe.train import ttt

    masks = []

    def flex(q, K, V, block_mask, enable_gqa):  # eager flex reads mask_mod only: the tables are compared apart
        masks.append(block_mask)
        return flex_attention(q, K, V, block_mask=block_mask, enable_gqa=enable_gqa)

    monkeypatch.setattr("eaglepipe.train.ttt.attention.flex_attention_fn", lambda: flex)
    torch.manual_seed(0)
    T, buffers, addresses = 2 * ttt.BLOCK, {}, []
    for cut in (100, 37):
        doc = torch.cat([torch.zeros(cut), torch.ones(120), torch.full((T - cut - 120,), 2)]).long()[None]
        kept, fresh = ttt.FlexTTTAttention(doc, buffers), ttt.FlexTTTAttention(doc)
        for _ in range(3):
            q, k, v = torch.randn(1, 4, T, 16), torch.randn(1, 2, T, 16), torch.randn(1, 2, T, 16)
            torch.testing.assert_close(kept.attend(q, k, v), fresh.attend(q, k, v), rtol=0, atol=0)
            a, b = (vars(m) for m in masks[-2:])
            assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a if isinstance(a[n], torch.Tensor))
        addresses.append({key: b.data_ptr() for key, b in buffers.items()})
    tables = [k for k in buffers if isinstance(k[0][1], str)]  # (step, field name) keys
    assert {k[0][1] for k in tables} >= {"kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"}
    assert len(buffers) - len(tables) == 3 * 3 and addresses[1] == addresses[0]
    assert len(set(addresses[0].values())) == len(buffers)
    assert torch.equal(buffers[((2, 0), (1, T + 1), torch.int64, torch.device("cpu"))][0, :T], doc[0])


def test_flex_attention_only_on_cuda_for_heads_of_16_or_more():
    """ttt.uses_flex: Inductor's flex_attention kernel refuses head_dim < 16 (the H200, torch 2.11), and the CPU
    has no fast flex kernel; the fast path attends plainly there (test_fast_path_equals_the_plain_path holds)."""
    from eaglepipe.train.ttt import uses_flex

    assert [uses_flex(hd, "cuda") for hd in (8, 15, 16, 64, 128)] == [False, False, True, True, True]
    assert not uses_flex(128, "cpu") and uses_flex(64, torch.device("cuda", 1))


def _block_table(num: torch.Tensor, idx: torch.Tensor, nkv: int) -> torch.Tensor:
    """BlockMask tables of one row, counts (1, 1, nq) and indices (1, 1, nq, ·) → (nq, nkv) bool: block listed."""
    nq = num.shape[-1]
    listed = torch.arange(idx.shape[-1])[None] < num[0, 0][:, None]  # (nq, ·)
    table = torch.zeros(nq, nkv, dtype=torch.bool)
    table[torch.arange(nq)[:, None].expand_as(listed)[listed], idx[0, 0][listed].long()] = True
    return table


def _kernel_mask(bm) -> torch.Tensor:
    """The (Q, KV) mask flex_attention's CUDA kernel applies for BlockMask ``bm`` (B = 1): every key of a full
    block, mask_mod in a partial block, nothing elsewhere (eager flex on the CPU evaluates mask_mod alone)."""
    from eaglepipe.train.ttt import BLOCK

    Q, KV = bm.seq_lengths
    expand = lambda t: t.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)  # noqa: E731 (nq, nkv) → (Q, KV)
    partial = expand(_block_table(bm.kv_num_blocks, bm.kv_indices, KV // BLOCK))
    full = expand(_block_table(bm.full_kv_num_blocks, bm.full_kv_indices, KV // BLOCK))
    return full | (partial & bm.mask_mod(0, 0, torch.arange(Q)[:, None], torch.arange(KV)[None]))


@pytest.mark.parametrize("lens", [[40, 800, 100, 84], [40, 984]])  # the second: a padded block with full ones
def test_compacted_flex_attention_equals_ttt_attention(lens, monkeypatch):
    """FlexTTTAttention at flex_rows' padded chain rows against TTTAttention at the exact rows, for a row of
    samples, each a prompt then its reply (T = 1024, 8 blocks; the second sample's reply fills query blocks).
    Checked two ways on the CPU: eager flex_attention (its mask_mod; eager flex reads no block tables), and
    dense attention under the mask the CUDA kernel applies from the block tables, which must be mask_mod's
    everywhere, padding included."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import flex_attention

    from eaglepipe.train import ttt

    torch.manual_seed(0)
    lens, T = torch.tensor(lens), 1024
    doc = torch.repeat_interleave(torch.arange(len(lens)), lens)  # (T,)
    pos = torch.cat([torch.arange(n) for n in lens.tolist()])
    reply = pos >= (2 * lens // 3)[doc]
    exact = ttt.chain_rows([(reply & (pos + 1 + j < lens[doc]))[None] for j in range(4)])
    rows = ttt.flex_rows(exact, T)
    calls = []

    def flex(q, K, V, block_mask, enable_gqa):
        calls.append((K, V, block_mask))
        return flex_attention(q, K, V, block_mask=block_mask, enable_gqa=enable_gqa)

    monkeypatch.setattr("eaglepipe.train.ttt.attention.flex_attention_fn", lambda: flex)
    fa, plain = ttt.FlexTTTAttention(doc[None]), TTTAttention(doc[None])
    n_full = 0
    for j, (r, at) in enumerate(zip(exact, rows)):
        N, n = (T, T) if r is None else (len(at), len(r))
        q, k, v = torch.randn(1, 4, N, 16), torch.randn(1, 2, N, 16), torch.randn(1, 2, N, 16)
        fa.at, plain.at = at, r
        got = fa.attend(q, k, v)
        want = plain.attend(q[:, :, :n], k[:, :, :n], v[:, :, :n])  # the padding is last
        torch.testing.assert_close(got[:, :, :n], want, rtol=1e-4, atol=1e-5)
        K, V, bm = calls[-1]
        Q, KV = bm.seq_lengths
        mask = _kernel_mask(bm)
        assert torch.equal(mask, bm.mask_mod(0, 0, torch.arange(Q)[:, None], torch.arange(KV)[None]))
        kern = F.scaled_dot_product_attention(q, repeat_kv(K, 2), repeat_kv(V, 2), attn_mask=mask)
        torch.testing.assert_close(kern[:, :, :n], want, rtol=1e-4, atol=1e-5)
        n_full += int(bm.full_kv_num_blocks.sum()) if j else 0
    assert n_full > 0 and len(rows[1]) < T // 2  # compacted steps use full blocks too


class HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that make the host wait for a CUDA device (an output whose shape or value the host must
    read: nonzero, .item(), boolean indexing, ...), run here on the CPU: none may run inside a CUDA graph's capture.
    flex_attention itself runs unseen (:meth:`unseen`): on CUDA it is one compiled kernel, not the CPU's eager ops."""

    OPS = {"nonzero", "_local_scalar_dense", "masked_select", "unique_dim", "_unique2", "unique_consecutive",
           "repeat_interleave", "masked_scatter", "equal", "is_nonzero", "bincount", "argwhere"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masks = name.startswith("index") and len(args) > 1 and isinstance(args[1], (list, tuple)) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if name in self.OPS or masks:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))

    @staticmethod
    def unseen(fn):
        """fn run with the dispatch modes off (eager flex_attention on the CPU compiles, which no mode may watch)."""
        def run(*args, **kwargs):
            with torch.utils._python_dispatch._disable_current_modes():
                return fn(*args, **kwargs)
        return run


def _padded_case(T: int, Tp: int):
    """_packed_case(T) prompt-reply, and the same padded to Tp (pad_batch; soft targets padded to match)."""
    from eaglepipe.train.ttt import pad_batch

    b, soft = _packed_case(T)
    b = _prompt_reply(b)
    pad = Tp - T
    psoft = SoftTargets(p=torch.cat([soft.p, torch.full((1, pad, 8), 1 / 8)], 1),
                        top=torch.cat([soft.top, torch.zeros(1, pad, dtype=torch.long)], 1),
                        top_in_vocab=torch.cat([soft.top_in_vocab, torch.zeros(1, pad, dtype=torch.bool)], 1))
    return b, soft, pad_batch(b, Tp), psoft


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_static_rows_give_the_plain_results_and_the_host_never_waits(draft, steps):
    """ttt_unroll_fast given static_rows (what eaglepipe.train.graphed captures): the plain path's loss, counts and
    gradients, with no op that reads a device value back (HostSyncs), forward and backward; the step without
    them does read back (the detector sees its nonzero)."""
    from eaglepipe.train.ttt import bucket_length, static_rows, ttt_unroll_fast

    embed = torch.randn(99, 32)
    b, soft, _, _ = _padded_case(700, 700)
    rows = static_rows(b, soft.top_in_vocab, steps)
    trained0 = align_step(b, soft, 0).trained[0].nonzero().squeeze(1)
    assert len(rows) == steps and len(rows[0]) == bucket_length(len(trained0), 700) > len(trained0)
    assert torch.equal(rows[0][: len(trained0)], trained0) and rows[0][len(trained0):].eq(700).all()
    results, grads = [], []
    for static in (False, True):
        draft.zero_grad(set_to_none=True)
        with HostSyncs() as syncs:
            r = ttt_unroll_fast(draft, embed, b, soft, steps, 0.8, rows=rows) if static else \
                ttt_unroll(draft, embed, b, soft, steps=steps, decay=0.8)
            r.loss.backward()
        assert (syncs.seen == []) == static, syncs.seen
        results.append(r)
        grads.append({k: v.grad.clone() for k, v in draft.named_parameters()})
    plain, static = results
    torch.testing.assert_close(static.loss, plain.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(static.step_loss, plain.step_loss, rtol=1e-5, atol=1e-6)
    for f in ("correct", "counted", "trained"):
        assert getattr(static, f).tolist() == getattr(plain, f).tolist(), f
    assert plain.trained[-1] > 0
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-4, atol=1e-6, msg=k)


def test_static_rows_on_the_flex_path_give_the_plain_results_and_the_host_never_waits(draft, monkeypatch):
    """The same as it runs on CUDA (flex attention, the row padded to BLOCK), forced on the CPU: eager
    flex_attention, forward only (no CPU backward); the block masks are built from the rows without a read-back."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from eaglepipe.train import ttt

    monkeypatch.setattr("eaglepipe.train.ttt.unroll.uses_flex", lambda head_dim, device: True)
    flex = ttt.flex_attention_fn()
    monkeypatch.setattr("eaglepipe.train.ttt.attention.flex_attention_fn", lambda: HostSyncs.unseen(flex))
    embed = torch.randn(99, 32)
    b, soft, pb, psoft = _padded_case(700, 768)
    rows = ttt.static_rows(pb, psoft.top_in_vocab, 3)
    with torch.no_grad():
        with HostSyncs() as syncs:
            static = ttt.ttt_unroll_fast(draft, embed, pb, psoft, 3, 0.8, rows=rows)
        plain = ttt_unroll(draft, embed, b, soft, steps=3, decay=0.8)
    assert syncs.seen == []
    torch.testing.assert_close(static.loss, plain.loss, rtol=1e-5, atol=1e-6)
    for f in ("correct", "counted", "trained"):
        assert getattr(static, f).tolist() == getattr(plain, f).tolist(), f
    with pytest.raises(ValueError, match="multiple of 128"):
        ttt.ttt_unroll_fast(draft, embed, b, soft, 3, 0.8, rows=ttt.static_rows(b, soft.top_in_vocab, 3))
