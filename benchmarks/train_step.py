"""One TTT training step (soft targets, unroll forward + backward, clipping, AdamW), eaglepipe's against the peer
trainers', on identical random inputs in one process: one packed row of ``--tokens`` tokens (seeded sample
lengths), aux states / h[N] in bf16, bf16 autocast with fp32 master weights for every implementation.

    python benchmarks/train_step.py                      # shapes A B, TTT 3 7, every implementation found
    python benchmarks/train_step.py --shapes A --impls eaglepipe-plain eaglepipe-fast --iters 4
    python benchmarks/train_step.py --loss-mask prompt-reply   # each sample a prompt (38.5 %), then its reply

Implementations (``impl`` in the JSON):
- ``eaglepipe-plain``: ttt.ttt_unroll as train.py runs it without ``train.fast`` (fp32 teacher product).
- ``eaglepipe-fast``: ``train.fast`` (ttt.ttt_unroll_fast + compile_draft + fused AdamW) with
  ``train.teacher_precision: tf32``.
- ``eaglepipe-fast-frozen``: the same with ``train.freeze_lm_head`` (speculators' default set-up).
- ``eaglepipe-fast-frozen-bf16t``: the same with a bf16 teacher product (what speculators computes).
- ``eaglepipe-fast-cg`` / ``eaglepipe-fast-frozen-cg``: ``eaglepipe-fast`` / ``-frozen`` with the compiled draft
  layer and norm replayed as CUDA graphs (``compile_draft(mode="reduce-overhead")``, Inductor's CUDA graph trees):
  shape A is launch-bound (924 kernels a step, 16 ms of GPU work in a 29–39 ms step), so fewer launches are its
  lever. The graph trees record a graph again whenever a static input has a new address (every step then
  re-records, and the rows run at a fraction of ``eaglepipe-fast``'s speed), so the mask_mod's tensors and the
  block tables are kept at fixed addresses (``ttt.fixed_address``). Give these rows ``--warmup`` ≥ 2: a graph's
  first call runs it, the second records it.
- ``eaglepipe-graph`` / ``eaglepipe-graph-frozen``: ``eaglepipe-fast`` / ``-frozen`` with the whole step (the
  unroll given ttt.static_rows, its backward, clipping, AdamW with ``capturable=True``) replayed as one CUDA graph
  (eaglepipe.train.graphed.GraphedStep), the soft targets inside it (at every position); static_rows runs eagerly before
  each replay. Written without a GPU (2026-12-04); not yet run on the H200.
- ``eaglepipe-fast-unroll-frozen``: experimental, the whole unroll as one torch.compile'd function (not yet run
  on the H200).
- ``speculators`` / ``speculators-lmhead``: speculators 0.9.0's Eagle3DraftModel.forward (its compiled forward,
  flex attention, its fused Triton KL loss kept out of the compiled graph), lm_head frozen (its default) / trained.
Peers are imported only here (``--peer-path``: where their wheels were installed); a missing peer is skipped.

Loss mask (``loss_mask`` in the JSON; every implementation gets the same inputs): ``iid`` (default, the rows
measured before this option): each token's loss_mask is an independent draw, True with probability 0.7, so
chain rows cover nearly every position; ``prompt-reply``: each sample's first ``--prompt-fraction`` of tokens is
prompt (loss_mask False), the rest its reply (True), as real rows are: eaglepipe's plain and fast steps then
compute TTT steps >= 1 only at the reply positions (ttt.chain_rows).

Figures: tokens_per_s = tokens / mean step time over ``--iters`` steps after ``--warmup`` steps;
peak_gib = torch.cuda.max_memory_allocated over set-up and steps, plus the shared embeddings eaglepipe holds
(speculators copies them into its model, so they are counted there); tflops = the step's matmul FLOPs (draft
forward and backward: qkv/o/MLP/lm_head per TTT step, fc once, weight gradients only for trained weights,
input gradients where needed, attention QKᵀ and PV over the visible keys, and the teacher's h[N]·lm_headᵀ
over the draft vocabulary) / step time, every position of every step counted whatever an implementation
skips (the same work credited to each); tflops_needed = needed_flops (only the work the loss needs: later
steps at their chain rows, unpadded; eaglepipe's fast step runs a little more, flex_rows' padding) / step time. Rows go to ``--out`` (rows of the same impl/shape/ttt/loss_mask are
replaced).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eaglepipe.model.draft import DraftConfig, Eagle3Draft  # noqa: E402
from eaglepipe.model.target_head import TargetHead, soft_targets  # noqa: E402
from eaglepipe.params import TrainParams  # noqa: E402
from eaglepipe.train.graphed import GraphedStep  # noqa: E402
from eaglepipe.train.ttt import (  # noqa: E402
    Batch,
    TTTUnroll,
    chain_rows,
    compile_draft,
    counted_trained,
    static_rows,
    ttt_unroll_fast,  # noqa: E402
)


@dataclass
class Shape:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    draft_vocab: int
    rope_theta: float
    norms: tuple[str, ...] = ()  # eaglepipe's draft: the EAGLE-3.1 norms switched on (train.draft_norms)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "A": Shape("A", 576, 9, 3, 1536, 49152, 8192, 100000.0),  # SmolLM2-135M target
    "B": Shape("B", 4096, 32, 8, 14336, 128256, 32000, 500000.0),  # Llama-3.1-8B target
}


def doc_lengths(tokens: int, seed: int) -> list[int]:
    """Sample lengths of one packed row: uniform in [256, 4096], the last one cut to fill the row."""
    g = torch.Generator().manual_seed(seed)
    out, n = [], 0
    while n < tokens:
        L = min(int(torch.randint(256, 4097, (1,), generator=g)), tokens - n)
        out.append(L)
        n += L
    return out


LOSS_MASKS = ("iid", "prompt-reply")
# The prompt share of a training row. The GPU profile's data with 32,000 self-written conversations (48,270 in
# all, extract's report): 7,727,944 loss tokens of 12,556,371, so 38.5 % prompt. (The CPU defaults' 128 conversations,
# reports/extract.json: 7,667 loss tokens of 24,103, 68.2 % prompt, the default before: it compacts more.)
PROMPT_FRACTION = 0.385


def make_inputs(s: Shape, tokens: int, seed: int, device, loss_mask: str = "iid",
                prompt_fraction: float = PROMPT_FRACTION) -> dict:
    """Random inputs of one packed row; ``loss_mask`` "iid" or "prompt-reply" (module docstring). The other
    inputs do not depend on it. Raises ValueError for another ``loss_mask``."""
    if loss_mask not in LOSS_MASKS:
        raise ValueError(f"loss_mask {loss_mask!r}: one of {LOSS_MASKS}")
    g = torch.Generator().manual_seed(seed)
    lens = doc_lengths(tokens, seed)
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lens)])[None]  # (1, T)
    pos = torch.cat([torch.arange(n) for n in lens])[None]  # (1, T)
    t2d = torch.zeros(s.vocab, dtype=torch.bool)
    t2d[torch.randperm(s.vocab, generator=g)[: s.draft_vocab]] = True
    x = dict(
        lens=lens,
        input_ids=torch.randint(0, s.vocab, (1, tokens), generator=g).to(device),
        positions=pos.to(device),
        doc=doc.to(device),
        loss_mask=(torch.rand(1, tokens, generator=g) < 0.7).to(device),  # iid; drawn either way (same inputs)
        aux=torch.randn(1, tokens, 3, s.hidden, generator=g).to(device, torch.bfloat16),
        last=(4 * torch.randn(1, tokens, s.hidden, generator=g)).to(device, torch.bfloat16),
        top_in_vocab=(torch.rand(1, tokens, generator=g) < 0.9).to(device),
        t2d=t2d.to(device),
        d2t=(t2d.nonzero().flatten() - torch.arange(s.draft_vocab)).to(device),
        embed=(0.02 * torch.randn(s.vocab, s.hidden, generator=g)).to(device),
        lm_head=(0.02 * torch.randn(s.vocab, s.hidden, generator=g)).to(device),
        norm=torch.ones(s.hidden, device=device),
    )
    if loss_mask == "prompt-reply":  # loss_mask[t]: x_{t+1} is reply text (the sample's last t: nothing follows)
        n = torch.tensor(lens)[doc]  # (1, T) length of each position's sample
        x["loss_mask"] = ((pos + 1 >= (prompt_fraction * n).round()) & (pos + 1 < n)).to(device)
    x["loss_mask_name"] = loss_mask
    return x


def matmul_flops(s: Shape, lens: list[int], ttt: int, lm_head_trained: bool) -> float:
    """Matmul FLOPs of one training step (see the module docstring)."""
    T, H, hd = sum(lens), s.hidden, s.head_dim
    per_tok = {  # forward FLOPs per token
        "qkv": 2 * 2 * H * (s.heads + 2 * s.kv_heads) * hd,
        "o": 2 * s.heads * hd * H,
        "mlp": 2 * 3 * H * s.intermediate,
        "lm_head": 2 * H * s.draft_vocab,
    }
    layer = 3 * (per_tok["qkv"] + per_tok["o"] + per_tok["mlp"])  # fwd + input grad + weight grad
    head = (3 if lm_head_trained else 2) * per_tok["lm_head"]
    fc = 2 * 2 * 3 * H * H  # fwd + weight grad (aux needs no gradient)
    teacher = 2 * H * s.draft_vocab
    causal = sum(n * (n + 1) / 2 for n in lens)  # step-0 keys visible, summed over queries
    attn = 0.0
    for j in range(ttt):  # QKᵀ and PV: 4·hd·nh FLOPs per visible key, ×3 with backward
        attn += 3 * 4 * hd * s.heads * (causal + j * T)
    return T * (ttt * (layer + head) + fc + teacher) + attn


def needed_flops(s: Shape, x: dict, ttt: int, lm_head_trained: bool) -> float:
    """Matmul FLOPs of the work a step needs (terms as matmul_flops'): step 0 at every position, step j ≥ 1
    only at its ttt.chain_rows (unpadded), the lm_head only where step j's loss is read (ttt.counted_trained's
    ``trained``), a later step's attention over its queries' causal step-0 keys plus j diagonal keys."""
    b = Batch(x["input_ids"].cpu(), x["positions"].cpu(), x["doc"].cpu(), x["loss_mask"].cpu(), None, None,
              x["top_in_vocab"].cpu())
    soft = SimpleNamespace(top_in_vocab=b.top_in_vocab)  # all counted_trained reads of the soft targets
    trained = [counted_trained(b, soft, j)[1] for j in range(ttt)]  # (1, T) bool each
    rows = chain_rows(trained) if ttt > 1 else [None]
    T, H, hd, pos = b.loss_mask.shape[1], s.hidden, s.head_dim, b.positions[0]
    layer = 3 * (2 * 2 * H * (s.heads + 2 * s.kv_heads) * hd + 2 * s.heads * hd * H + 2 * 3 * H * s.intermediate)
    head = (3 if lm_head_trained else 2) * 2 * H * s.draft_vocab
    attn_key = 3 * 4 * hd * s.heads  # per visible key, forward and backward
    total = T * (2 * 2 * 3 * H * H + 2 * H * s.draft_vocab)  # fc, teacher
    total += T * layer + attn_key * sum(n * (n + 1) / 2 for n in x["lens"])  # step 0
    for j, r in enumerate(rows[1:], start=1):
        total += r.numel() * layer + attn_key * (float((pos[r] + 1).sum()) + j * r.numel())
    return total + head * sum(int(t.sum()) for t in trained)


# ---------------------------------------------------------------- eaglepipe


def seeded_draft(s: Shape, x: dict) -> Eagle3Draft:
    """eaglepipe's draft at shape ``s`` (seed 0, the inputs' draft vocabulary, ``s.norms``), on CUDA."""
    cfg = DraftConfig(s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, 1e-5, s.rope_theta, 131072,
                      s.hidden, 3, s.draft_vocab, s.vocab, **{flag: True for flag in s.norms})
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    draft.set_vocab(x["d2t"].cpu(), x["t2d"].cpu())
    return draft.cuda()


def draft_and_head(s: Shape, x: dict, frozen: bool) -> tuple[Eagle3Draft, TargetHead]:
    """:func:`seeded_draft` with lm_head from the target's draft rows (trained unless ``frozen``) and the target
    head cut to the draft rows, as train.py sets them up."""
    draft = seeded_draft(s, x)
    with torch.no_grad():
        draft.lm_head.weight.copy_(x["lm_head"][x["t2d"]])
    draft.lm_head.weight.requires_grad_(not frozen)
    return draft, TargetHead(x["norm"], 1e-5, x["lm_head"], x["embed"], tied=False).draft_rows(x["t2d"])


def eaglepipe_impl(s: Shape, x: dict, ttt: int, fast: bool, teacher: str = "fp32", frozen: bool = False,
                   whole_unroll: bool = False, cudagraphs: bool = False):
    draft, head = draft_and_head(s, x, frozen)
    unroll = TTTUnroll(draft, head.embed, ttt, 0.8, fast=fast)
    if whole_unroll:  # experimental: the whole unroll as one compiled function
        fn = torch.compile(ttt_unroll_fast)
        unroll = lambda b, soft: fn(draft, head.embed, b, soft, ttt, 0.8)  # noqa: E731
    elif fast:
        compile_draft(draft, mode="reduce-overhead" if cudagraphs else None)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=fast)
    batch = Batch(x["input_ids"], x["positions"], x["doc"], x["loss_mask"], x["aux"], x["last"], x["top_in_vocab"])

    def step():
        if cudagraphs:  # a new training step: the previous step's graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        soft = soft_targets(head, batch.last, draft.t2d, batch.top_in_vocab, precision=teacher, need=batch.loss_mask)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            r = unroll(batch, soft)
        r.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return r.loss.detach()

    return step, not frozen, x["embed"].numel() * x["embed"].element_size()  # the shared embeddings it holds


def eaglepipe_graph_impl(s: Shape, x: dict, ttt: int, frozen: bool = False):
    """``eaglepipe-fast`` (tf32 teacher) with the whole step replayed as a CUDA graph (:class:`GraphedStep`)."""
    draft, head = draft_and_head(s, x, frozen)
    compile_draft(draft)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True, capturable=True)
    batch = Batch(x["input_ids"], x["positions"], x["doc"], x["loss_mask"], x["aux"], x["last"], x["top_in_vocab"])

    def body(b: Batch, rows):  # inside the graph: soft targets at every position (``need`` would read back)
        soft = soft_targets(head, b.last, draft.t2d, b.top_in_vocab, precision="tf32")
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):  # as make_graphed_callables asks
            r = ttt_unroll_fast(draft, head.embed, b, soft, ttt, 0.8, rows=rows)
        r.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        return r

    graphed = GraphedStep(body, params, opt)

    def step():
        return graphed(batch, static_rows(batch, batch.top_in_vocab, ttt)).loss.detach()

    return step, not frozen, x["embed"].numel() * x["embed"].element_size()


# ---------------------------------------------------------------- speculators 0.9.0


def install_stubs() -> None:
    """speculators imports openai, datasets and hs_connectors in modules its draft step never runs."""
    import importlib.abc
    import importlib.machinery
    import types

    class Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        roots = ("openai", "datasets", "hs_connectors")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.roots:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def create_module(self, spec):
            m = Stub(spec.name)
            m.__path__ = []
            return m

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Finder())


def speculators_impl(s: Shape, x: dict, ttt: int, train_lm_head: bool = False, attn: str = "simple_flex_attention"):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses.utils import kl_div_loss
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    tl = LlamaConfig(hidden_size=s.hidden, intermediate_size=s.intermediate, num_attention_heads=s.heads,
                     num_key_value_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=s.vocab, num_hidden_layers=1,
                     rms_norm_eps=1e-5, rope_theta=s.rope_theta, max_position_embeddings=131072)
    tl._attn_implementation = attn
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=s.draft_vocab, norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])),
    )
    torch.manual_seed(0)
    model = Eagle3DraftModel(cfg)
    model.load_vocab_mappings(x["t2d"].cpu(), x["d2t"].cpu())
    model = model.cuda() if x["aux"].is_cuda else model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.isnan().any():
                p.normal_(0, 0.02)
        model.embed_tokens.weight.copy_(x["embed"])
        model.lm_head.weight.copy_(x["lm_head"][x["t2d"]])
        model.verifier_lm_head.weight.copy_(x["lm_head"][x["t2d"]])
        model.verifier_norm.weight.copy_(x["norm"])
    model.lm_head.weight.requires_grad_(train_lm_head)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    loss_config = {"kl_div": (torch.compiler.disable(kl_div_loss) if x["aux"].is_cuda else _eager_kl(), 1.0)}
    dev = x["aux"].device.type
    hs = x["aux"].flatten(-2)  # (1, T, 3H) bf16, as its data loader gives
    pos = x["positions"] + 1  # its positions start at 1 (1 + arange)

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            _, loss, _ = model(hidden_states=hs if dev == "cuda" else hs.float(), input_ids=x["input_ids"],
                               document_ids=x["doc"], loss_mask=x["loss_mask"], position_ids=pos,
                               verifier_last_hidden_states=x["last"] if dev == "cuda" else x["last"].float(),
                               ttt_steps=ttt, ttt_step_loss_decay=0.8, loss_config=loss_config)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, train_lm_head, 0  # its embeddings and teacher rows are its own copies (counted)


def _eager_kl():
    from speculators.losses.utils import resolve_loss_config

    return resolve_loss_config("kl_div", "eager")["kl_div"][0]


# ---------------------------------------------------------------- runner

IMPLS = {
    "eaglepipe-plain": lambda s, x, t: eaglepipe_impl(s, x, t, fast=False),
    "eaglepipe-fast": lambda s, x, t: eaglepipe_impl(s, x, t, fast=True, teacher="tf32"),
    "eaglepipe-fast-frozen": lambda s, x, t: eaglepipe_impl(s, x, t, fast=True, teacher="tf32", frozen=True),
    "eaglepipe-fast-frozen-bf16t": lambda s, x, t: eaglepipe_impl(s, x, t, fast=True, teacher="bf16", frozen=True),
    "eaglepipe-fast-unroll-frozen": lambda s, x, t: eaglepipe_impl(s, x, t, fast=True, teacher="tf32", frozen=True,
                                                                   whole_unroll=True),
    "eaglepipe-fast-cg": lambda s, x, t: eaglepipe_impl(s, x, t, fast=True, teacher="tf32", cudagraphs=True),
    "eaglepipe-fast-frozen-cg": lambda s, x, t: eaglepipe_impl(s, x, t, fast=True, teacher="tf32", frozen=True,
                                                               cudagraphs=True),
    "eaglepipe-graph": lambda s, x, t: eaglepipe_graph_impl(s, x, t),
    "eaglepipe-graph-frozen": lambda s, x, t: eaglepipe_graph_impl(s, x, t, frozen=True),
    "speculators": lambda s, x, t: speculators_impl(s, x, t),
    "speculators-lmhead": lambda s, x, t: speculators_impl(s, x, t, train_lm_head=True),
}


def measure(impl: str, s: Shape, x: dict, ttt: int, warmup: int, iters: int, profile: str | None = None) -> dict:
    """One row of the JSON (module docstring); with ``profile`` (a folder) also :func:`profile_steps`' table."""
    torch._dynamo.reset()  # each implementation compiles afresh (no cache-size limit carried over)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.time()
    step, lm_trained, held = IMPLS[impl](s, x, ttt)
    for _ in range(warmup):
        loss = step()
    torch.cuda.synchronize()
    t_warm = time.time() - t0
    t0 = time.time()
    for _ in range(iters):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.time() - t0) / iters
    T = x["input_ids"].shape[1]
    row = {
        "impl": impl, "shape": s.name, "ttt": ttt, **({"draft_norms": list(s.norms)} if impl.startswith("eaglepipe")
                                                     else {}),
        "tokens_per_s": round(T / dt),
        "peak_gib": round((torch.cuda.max_memory_allocated() - base + held) / 2**30, 2),
        "tflops": round(matmul_flops(s, x["lens"], ttt, lm_trained) / dt / 1e12, 1),
        "tflops_needed": round(needed_flops(s, x, ttt, lm_trained) / dt / 1e12, 1),
        "step_ms": round(1000 * dt, 1), "warmup_s": round(t_warm, 1), "loss": round(float(loss), 4),
    }
    if profile:
        profile_steps(step, Path(profile) / f"{impl}_{s.name}_ttt{ttt}_{x['loss_mask_name']}.txt")
    del step
    gc.collect()
    torch.cuda.empty_cache()
    return row


def profile_steps(step, path: Path, n: int = 2) -> None:
    """torch.profiler over n more steps → path: the step's kernel count, the ops by self CUDA time and by self CPU
    time (top 30 each)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    kernels = sum(e.count for e in prof.events() if e.device_type.name == "CUDA") / n
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{n} steps; CUDA kernels per step: {kernels:.0f}\n"
                    + ka.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60)
                    + "\n\nBy self CPU time (the host's share: launches, Python, waits at syncs):\n"
                    + ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    print(f"profiled → {path}", flush=True)


def parity_check(s: Shape, tokens: int, ttt: int, mask: dict) -> dict:
    """Plain vs fast step on CUDA (bf16 autocast): loss and gradient relative differences, same weights/inputs;
    ``mask``: make_inputs' loss_mask (and prompt_fraction) arguments, recorded in the result."""
    x = make_inputs(s, tokens, 1, "cuda", **mask)
    out = {}
    for fast in (False, True):
        draft = seeded_draft(s, x)
        head = TargetHead(x["norm"], 1e-5, x["lm_head"], x["embed"], tied=False)
        b = Batch(x["input_ids"], x["positions"], x["doc"], x["loss_mask"], x["aux"], x["last"], x["top_in_vocab"])
        soft = soft_targets(head, b.last, draft.t2d, b.top_in_vocab, need=b.loss_mask)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            r = TTTUnroll(draft, head.embed, ttt, 0.8, fast=fast)(b, soft)
        r.loss.backward()
        out[fast] = (r, {k: p.grad.float() for k, p in draft.named_parameters()})
    (rp, gp), (rf, gf) = out[False], out[True]
    rel = {k: float((gf[k] - gp[k]).norm() / gp[k].norm().clamp(min=1e-30)) for k in gp}
    return {"shape": s.name, "tokens": tokens, "ttt": ttt, **mask,
            "loss_plain": float(rp.loss), "loss_fast": float(rf.loss),
            "loss_rel_diff": abs(float(rf.loss) - float(rp.loss)) / abs(float(rp.loss)),
            "counts_equal": rp.counted.tolist() == rf.counted.tolist() and rp.trained.tolist() == rf.trained.tolist(),
            "correct_plain": rp.correct.tolist(), "correct_fast": rf.correct.tolist(),
            "grad_rel_diff_max": max(rel.values()), "grad_rel_diff": rel}


def teacher_check(s: Shape, tokens: int) -> dict:
    """Soft targets with a tf32 / bf16 teacher product against fp32 (random h[N]: a lead, not a τ measurement)."""
    x = make_inputs(s, tokens, 2, "cuda")
    head = TargetHead(x["norm"], 1e-5, x["lm_head"], x["embed"], tied=False)
    ref = soft_targets(head, x["last"], x["t2d"], x["top_in_vocab"], precision="fp32")
    out = {"shape": s.name, "tokens": tokens}
    for prec in ("tf32", "bf16"):
        st = soft_targets(head, x["last"], x["t2d"], x["top_in_vocab"], precision=prec)
        out[prec] = {"max_abs_dp": float((st.p - ref.p).abs().max()),
                     "top1_agree": float((st.top == ref.top).float().mean()),
                     "kl": float((ref.p * (ref.p.clamp_min(1e-30).log() - st.p.clamp_min(1e-30).log())).sum(-1).mean())}
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'impl':28} {'shape':5} {'ttt':>3} {'mask':12} {'tok/s':>9} {'peak GiB':>9} {'TFLOP/s':>8} {'%peak':>6} "
          f"{'ms':>8}")
    for r in rows:
        print(f"{r['impl']:28} {r['shape']:5} {r['ttt']:>3} {r.get('loss_mask', 'iid'):12} {r['tokens_per_s']:>9} "
              f"{r['peak_gib']:>9} {r['tflops']:>8} {100 * r['tflops'] / 790:>5.1f}% {r.get('step_ms', 0):>8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["A", "B"])
    ap.add_argument("--ttt", nargs="+", type=int, default=[3, 7])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--loss-mask", choices=LOSS_MASKS, default="iid",
                    help="iid: independent draws (the rows measured before this option); prompt-reply: each sample "
                         "a prompt, then its reply (see the module docstring)")
    ap.add_argument("--prompt-fraction", type=float, default=PROMPT_FRACTION,
                    help="prompt-reply: the share of each sample that is prompt (default: the GPU profile's data)")
    ap.add_argument("--checks", action="store_true", help="also the plain-vs-fast and teacher-precision checks")
    ap.add_argument("--draft-norms", nargs="*", default=TrainParams.model_fields["draft_norms"].default,
                    help="eaglepipe's draft: the EAGLE-3.1 norms (default: train.draft_norms' default; none: plain)")
    ap.add_argument("--peer-path", default=None, help="folder the peers' wheels were installed into")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "h200" / "train_step.json"))
    ap.add_argument("--profile", default=None, help="folder: a torch.profiler table of 2 more steps per row")
    a = ap.parse_args()
    mask = {"loss_mask": a.loss_mask, **({"prompt_fraction": a.prompt_fraction} if a.loss_mask == "prompt-reply"
                                          else {})}  # make_inputs' arguments, and keys of each JSON row
    if a.peer_path:  # after the image's own packages: only what is missing there comes from the wheels
        sys.path.append(a.peer_path)
    install_stubs()
    torch._dynamo.config.cache_size_limit = 64
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # the fp32 teacher is true fp32 unless asked (the new
    # API only: target_head's tf32 teacher uses it, and torch raises on a mix of the legacy and new ones)
    out = Path(a.out)
    rows = json.loads(out.read_text()) if out.exists() else []
    device = torch.cuda.get_device_name()
    print("device:", device, "torch", torch.__version__, flush=True)
    checks = []
    if a.checks:
        for c in (lambda: parity_check(SHAPES["A"], 4096, 3, mask), lambda: parity_check(SHAPES["B"], 4096, 3, mask),
                  lambda: teacher_check(SHAPES["B"], 4096)):
            try:
                checks.append(c())
                print(json.dumps({k: v for k, v in checks[-1].items() if k != "grad_rel_diff"}), flush=True)
            except Exception:
                traceback.print_exc()
        (out.parent / "train_step_checks.json").write_text(json.dumps(checks, indent=1) + "\n")
        gc.collect()
        torch.cuda.empty_cache()
    new = []
    for sname in a.shapes:
        s = replace(SHAPES[sname], norms=tuple(a.draft_norms))
        x = make_inputs(s, a.tokens, 0, "cuda", **mask)
        for ttt in a.ttt:
            for impl in a.impls:
                try:
                    r = measure(impl, s, x, ttt, a.warmup, a.iters, a.profile)
                except Exception as e:  # a peer that fails is reported, the others still run
                    traceback.print_exc()
                    print(f"FAILED {impl} {sname} ttt={ttt}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                r.update(mask, device=device, measured=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
                new.append(r)
                print_table([r])
                sys.stdout.flush()
                write_rows(out, rows, new)
        del x
        gc.collect()
        torch.cuda.empty_cache()
    print()
    print_table(write_rows(out, rows, new))


def row_key(r: dict) -> tuple:
    """What a row measured: impl, shape, TTT steps, loss mask (rows without one: iid, measured before it) and
    eaglepipe's draft norms (rows without them: the plain draft)."""
    return (r["impl"], r["shape"], r["ttt"], r.get("loss_mask", "iid"), r.get("prompt_fraction", 0.0),
            tuple(r.get("draft_norms", ())))


def write_rows(out: Path, old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` rows without those that ``new`` measured again (:func:`row_key`), plus ``new``; written to ``out``."""
    keys = {row_key(r) for r in new}
    rows = sorted([r for r in old if row_key(r) not in keys] + new,
                  key=lambda r: (r["shape"], r["ttt"], r["impl"], *row_key(r)[3:]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
