"""eaglepipe.train.graphed: the whole training step replayed as a CUDA graph gives the eager fast step's losses and
weights, call for call, across two row shapes (two graphs). CUDA only: skipped elsewhere with the reason. The
step it captures (ttt_unroll_fast given static_rows) is tested on the CPU in tests/test_ttt.py."""

import copy
import dataclasses

import pytest
import torch
from test_ttt import _padded_case, draft  # noqa: F401  (draft: the fixture)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA graphs exist only there")


def _eager_and_graphed(model):
    """Two compiled CUDA copies of the draft ``model``: (eager, its fused AdamW, graphed, its parameters, its capturable
    fused AdamW), both at lr 1e-3."""
    from eaglepipe.train.ttt import compile_draft

    eager, graphed = model.cuda(), copy.deepcopy(model).cuda()
    for d in (eager, graphed):
        compile_draft(d)
    params = list(graphed.parameters())
    return (eager, torch.optim.AdamW(eager.parameters(), lr=1e-3, fused=True), graphed, params,
            torch.optim.AdamW(params, lr=1e-3, fused=True, capturable=True))


@pytest.mark.parametrize("fused", [False, True])
def test_the_warm_up_is_undone_so_a_capturing_call_is_one_step(fused):
    """GraphedStep's warm-up runs real optimizer steps; _snapshot/_restore put the weights and AdamW's state back
    (state created meanwhile zeroed, its initial value), so one more step lands where one step from the start
    does (CPU: the AdamW here is the same update as the capturable one on CUDA)."""
    from eaglepipe.train.graphed import _restore, _snapshot

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3))
    x = torch.randn(7, 5)

    def step(opt):
        opt.zero_grad(set_to_none=True)
        (x @ w).square().sum().backward()
        opt.step()

    ref = torch.nn.Parameter(w.detach().clone())  # one step from the start
    opt_ref = torch.optim.AdamW([ref], lr=0.1, fused=fused)
    (x @ ref).square().sum().backward()
    opt_ref.step()

    opt = torch.optim.AdamW([w], lr=0.1, fused=fused)
    for rounds in range(2):  # the first warm-up creates the state, the second finds it
        saved = _snapshot([w], opt)
        for _ in range(3):
            step(opt)
        assert not torch.equal(w, saved["params"][0])
        _restore(saved, [w], opt)
        torch.testing.assert_close(w.detach(), saved["params"][0], rtol=0, atol=0)
        if rounds == 0:
            assert all(v.eq(0).all() for v in opt.state[w].values())
            step(opt)
            torch.testing.assert_close(w.detach(), ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(opt.state[w]["exp_avg"], opt_ref.state[ref]["exp_avg"], rtol=0, atol=0)


@CUDA
def test_graphed_steps_equal_the_eager_steps(draft):  # noqa: F811
    """Six calls over two row shapes (graphs captured at calls 1 and 3, each after its warm-up, which the restore
    undoes), the first graph also replayed on other data of its shape (ids, features, soft targets): each call's
    loss and counts equal an eager fast step's, and the weights after all six."""
    from eaglepipe.model.target_head import SoftTargets
    from eaglepipe.train.graphed import GraphedStep
    from eaglepipe.train.ttt import static_rows, ttt_unroll_fast

    embed = torch.randn(99, 32, device="cuda")
    cases = []
    for later_reply in (False, True):  # two prompt shares: rows (256, 256, 256) and (128, 128, 128), two graphs
        _, _, pb, psoft = _padded_case(700, 768)
        if later_reply:
            pb.loss_mask[:, :600] = False
        cases.append((pb.to("cuda"), SoftTargets(psoft.p.cuda(), psoft.top.cuda(), psoft.top_in_vocab.cuda())))
    b0, s0 = cases[0]  # the first shape again, other values: the graph must read its inputs, not replay its capture
    g = torch.Generator(device="cuda").manual_seed(1)
    p = torch.softmax(3 * torch.randn(s0.p.shape, generator=g, device="cuda"), -1)
    ids = torch.randint(0, 99, b0.input_ids.shape, generator=g, device="cuda")
    aux = torch.randn(b0.aux.shape, generator=g, device="cuda")
    cases.append((dataclasses.replace(b0, input_ids=ids, aux=aux), SoftTargets(p, p.argmax(-1), s0.top_in_vocab)))
    keys = [tuple(len(r) for r in static_rows(b, s.top_in_vocab, 3)) for b, s in cases]
    assert keys[0] == keys[2] != keys[1]
    eager, opt_e, graphed, params, opt_g = _eager_and_graphed(draft)
    soft = SoftTargets(*(t.clone() for t in (cases[0][1].p, cases[0][1].top, cases[0][1].top_in_vocab)))

    def body(b, rows):  # the soft targets are an input buffer here (the benchmark computes them in the graph)
        r = ttt_unroll_fast(graphed, embed, b, soft, 3, 0.8, rows=rows)
        r.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt_g.step()
        return r

    step = GraphedStep(body, params, opt_g)
    for i in (0, 0, 1, 2, 0, 1):
        b, s = cases[i]
        opt_e.zero_grad(set_to_none=True)
        want = ttt_unroll_fast(eager, embed, b, s, 3, 0.8)
        want.loss.backward()
        torch.nn.utils.clip_grad_norm_(list(eager.parameters()), 0.5)
        opt_e.step()
        for dst, src in ((soft.p, s.p), (soft.top, s.top), (soft.top_in_vocab, s.top_in_vocab)):
            dst.copy_(src)
        got = step(b, static_rows(b, s.top_in_vocab, 3))
        torch.testing.assert_close(got.loss, want.loss.detach(), rtol=1e-4, atol=1e-5)
        for f in ("correct", "counted", "trained"):
            assert getattr(got, f).tolist() == getattr(want, f).tolist(), f
    assert len(step.graphs) == 2
    for (k, pe), pg in zip(eager.named_parameters(), params):
        torch.testing.assert_close(pg, pe, rtol=1e-3, atol=1e-5, msg=k)


@CUDA
def test_graphed_step_refuses_a_batch_of_another_shape(draft):  # noqa: F811
    from eaglepipe.train.graphed import GraphedStep

    params = list(draft.cuda().parameters())
    step = GraphedStep(lambda b, rows: None, params, torch.optim.AdamW(params, capturable=True))
    _, _, pb, _ = _padded_case(700, 768)
    step.batch = pb.to("cuda")
    _, _, other, _ = _padded_case(700, 896)
    with pytest.raises(ValueError, match="one shape"):
        step(other.to("cuda"), [])


@CUDA
def test_a_capture_survives_another_thread_pinning_host_memory(draft):  # noqa: F811
    """train_drafter's feature worker pins host batches while the step thread captures; a pinned allocation
    (cudaHostAlloc) from another thread invalidated a capture in CUDA's global mode
    (cudaErrorStreamCaptureInvalidated). Here a thread allocates pinned buffers of fresh sizes without pause,
    emptying the pinned cache between rounds, all through two captures and their replays: every call's loss
    equals an eager fast step's."""
    import threading

    from eaglepipe.train.graphed import GraphedStep
    from eaglepipe.train.ttt import static_rows, ttt_unroll_fast

    embed = torch.randn(99, 32, device="cuda")
    _, _, pb, psoft = _padded_case(700, 768)
    b = pb.to("cuda")
    soft = dataclasses.replace(psoft, p=psoft.p.cuda(), top=psoft.top.cuda(), top_in_vocab=psoft.top_in_vocab.cuda())
    eager, opt_e, graphed, params, opt_g = _eager_and_graphed(draft)

    def body(batch, rows):
        r = ttt_unroll_fast(graphed, embed, batch, soft, 3, 0.8, rows=rows)
        r.loss.backward()
        opt_g.step()
        return r

    stop, allocs = threading.Event(), [0]

    def pin_without_pause():
        kept = []
        while not stop.is_set():
            kept.append(torch.empty((1 << 18) + 64 * allocs[0], dtype=torch.uint8, pin_memory=True))
            allocs[0] += 1
            if len(kept) == 64:
                kept.clear()
                torch._C._host_emptyCache()  # the next round's buffers are new cudaHostAlloc calls

    worker = threading.Thread(target=pin_without_pause, daemon=True)
    worker.start()
    try:
        while allocs[0] == 0:
            pass
        step = GraphedStep(body, params, opt_g)
        for later_reply in (False, False, True, True):  # two graphs: a capture and a replay each
            if later_reply:
                b.loss_mask[:, :600] = False
            opt_e.zero_grad(set_to_none=True)
            want = ttt_unroll_fast(eager, embed, b, soft, 3, 0.8)
            want.loss.backward()
            opt_e.step()
            got = step(b, static_rows(b, soft.top_in_vocab, 3))
            torch.testing.assert_close(got.loss, want.loss.detach(), rtol=1e-4, atol=1e-5)
    finally:
        stop.set()
        worker.join()
    assert len(step.graphs) == 2 and allocs[0] > 100
