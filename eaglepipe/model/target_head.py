"""The target's output head (final RMSNorm + lm_head) and embeddings, read from its HF folder without building
the model; and the soft targets the draft is trained against.

Soft targets: p = softmax(lm_head(norm(h[N]))) restricted to the draft vocabulary and renormalised, i.e.
softmax over the logits of the draft-vocab columns only (the EAGLE-3 / SpecForge / speculators rule).

When the target's top-1 token lies OUTSIDE the draft vocabulary, the draft cannot propose it: under greedy
verification that position is always rejected. Following EAGLE-3 and SpecForge, such positions are dropped from
the loss (training the draft toward the runner-up would spend capacity on a guaranteed miss), they count as
misses in the accuracy (so τ_sim stays honest), and their share is reported as ``oov_top1`` (see ttt.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eaglepipe.errors import EaglepipeError
from eaglepipe.target.config import lm_fields, read_target_config

NORM, EMBED, HEAD = "model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"
# Where a checkpoint keeps its decoder: a causal LM under model., a multimodal wrapper under one of the others
# (transformers 5 writes Qwen2.5-VL's as model.; Kimi-K2.5's hub checkpoint: language_model.model., its head
# language_model.lm_head).
PREFIXES = (("model.", ""), ("model.language_model.", ""), ("language_model.model.", "language_model."))


@dataclass
class TargetHead:
    norm_weight: torch.Tensor  # (H,)
    eps: float
    lm_head: torch.Tensor  # (V, H); the embedding matrix itself when the target ties them
    embed: torch.Tensor  # (V, H), frozen, shared with the draft
    tied: bool
    draft_only: bool = False  # lm_head holds only the draft vocabulary's rows (Vd, H), in draft-id order

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    def to(self, device) -> "TargetHead":
        return TargetHead(self.norm_weight.to(device), self.eps, self.lm_head.to(device), self.embed.to(device), self.tied,
                          self.draft_only)

    def draft_rows(self, t2d: torch.Tensor) -> "TargetHead":
        """This head with lm_head cut to the draft vocabulary's rows (Vd, H): what the soft targets need once
        top_in_vocab is known; an untied 8B target's full fp32 lm_head (2 GiB) then leaves the device."""
        rows = self.lm_head if self.draft_only else self.lm_head[t2d]  # (Vd, H)
        return TargetHead(self.norm_weight, self.eps, rows, self.embed, self.tied, draft_only=True)

    def logits(self, last: torch.Tensor, rows: torch.Tensor | None = None, precision: str = "fp32") -> torch.Tensor:
        """h[N] (..., H) → logits (..., V) in fp32 (HF order: norm in fp32, weight, then lm_head); ``rows``
        (R, H) replaces lm_head (e.g. only its draft-vocabulary rows) → (..., R).

        precision: of the lm_head product on CUDA — ``fp32`` (exact), ``tf32`` (fp32 in/out, 10-bit mantissa
        products, ~8× faster on Hopper) or ``bf16`` (bf16 products, fp32 accumulation; what the engines serve
        with). The norm and the softmax after it stay fp32. Off CUDA always fp32."""
        x = last.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., H)
        x = self.norm_weight.float() * x  # (..., H)
        w = self.lm_head if rows is None else rows  # (V | R, H)
        if not x.is_cuda or precision == "fp32":
            return x @ w.float().T  # (..., V | R)
        if precision == "bf16":
            return (x.bfloat16() @ w.bfloat16().T).float()  # (..., V | R)
        if precision != "tf32":
            raise ValueError(f"teacher precision {precision!r}: fp32 | tf32 | bf16")
        # torch's fp32_precision API, not the legacy allow_tf32: once inductor (the compiled online target) has
        # used the new one, reading allow_tf32 raises "mix of the legacy and new APIs" (torch 2.11, CUDA)
        old = torch.backends.cuda.matmul.fp32_precision
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        try:
            return x @ w.float().T  # (..., V | R)
        finally:
            torch.backends.cuda.matmul.fp32_precision = old


@dataclass
class SoftTargets:
    p: torch.Tensor  # (..., Vd) fp32, the target distribution over the draft vocabulary (sums to 1)
    top: torch.Tensor  # (..., ) int64 draft id of the restricted argmax
    top_in_vocab: torch.Tensor  # (..., ) bool: the FULL-vocab argmax is in the draft vocabulary


@torch.no_grad()
def soft_targets(
    head: TargetHead, last: torch.Tensor, t2d: torch.Tensor, top_in_vocab: torch.Tensor | None = None,
    chunk: int | None = None, precision: str = "fp32", need: torch.Tensor | None = None,
) -> SoftTargets:
    """last (B, T, H) → SoftTargets over the draft vocabulary, ``chunk`` tokens at a time (V is large).

    Finding whether the full-vocabulary top-1 is in the draft vocabulary needs the (T, V) product; when the
    caller already knows it (``top_in_vocab`` (B, T) bool, computed once per sample by
    eaglepipe.train.prepare.top1_in_vocab), only the Vd draft rows of lm_head are multiplied — V/Vd times less
    work (6× for SmolLM2 with Vd = 8192) every epoch.
    need: (B, T) bool, the positions whose targets are read (a batch's ``loss_mask``: the TTT loss scores
    p_{t+1+j} only where x_{t+1+j} is assistant text); the others are not multiplied and get p = 0, top = 0
    and, when computed here, top_in_vocab False (a third of the CPU defaults' tokens are assistant text).
    precision: of the lm_head product (:meth:`TargetHead.logits`). chunk: tokens per product (default: 1024 on
    CPU, ~64M logits and at least 1024 tokens on CUDA).
    """
    B, T, _ = last.shape
    flat = last.reshape(B * T, -1)  # (B·T, H)
    idx = None if need is None else need.reshape(-1).nonzero().squeeze(1)  # (n,) the rows computed
    sel = flat if idx is None else flat[idx]  # (n, H)
    if head.draft_only and top_in_vocab is None:
        raise ValueError("a head cut to the draft rows (draft_rows) needs top_in_vocab")
    rows = None if top_in_vocab is None else head.lm_head if head.draft_only else head.lm_head[t2d]  # (Vd, H)
    if chunk is None:  # CPU: 1024 as before; CUDA: ~64M logits a product
        width = head.lm_head.shape[0] if rows is None else rows.shape[0]  # V or Vd
        chunk = max(1024, (1 << 26) // width) if last.is_cuda else 1024
    ps, inv = [], []
    for a in range(0, sel.shape[0], chunk):
        logits = head.logits(sel[a : a + chunk], rows, precision)  # (c, V), or (c, Vd) with rows
        if rows is None:
            inv.append(t2d[logits.argmax(-1)])  # (c,)
            logits = logits[:, t2d]  # (c, Vd)
        ps.append(torch.softmax(logits, dim=-1))  # (c, Vd)
    Vd = rows.shape[0] if rows is not None else ps[0].shape[1] if ps else int(t2d.sum())  # t2d: bool (V,)
    p = torch.cat(ps) if ps else flat.new_zeros(0, Vd, dtype=torch.float32)  # (n, Vd)
    if rows is None:  # top_in_vocab computed here
        top_in_vocab = torch.cat(inv) if inv else torch.zeros(0, dtype=torch.bool, device=flat.device)  # (n,)
        if idx is not None:
            top_in_vocab = top_in_vocab.new_zeros(B * T).index_copy_(0, idx, top_in_vocab)
        top_in_vocab = top_in_vocab.view(B, T)
    if idx is not None:  # back to every position, zeros where not needed
        p = p.new_zeros(B * T, Vd).index_copy_(0, idx, p)
    p = p.view(B, T, Vd)  # (B, T, Vd)
    return SoftTargets(p=p, top=p.argmax(-1), top_in_vocab=top_in_vocab)  # (B, T, Vd), (B, T), (B, T)


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name → safetensors file holding it (single file or a sharded index)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise EaglepipeError(f"{folder}: no model.safetensors or model.safetensors.index.json (the target stage writes one)")
    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def load_target_head(folder: str | Path) -> TargetHead:
    """Read norm / lm_head / embed_tokens (fp32) and rms_norm_eps from the target's HF folder (a multimodal
    wrapper's: its language model's, under a :data:`PREFIXES` prefix and ``text_config``)."""
    folder = Path(folder)
    cfg = read_target_config(folder)
    files = _weight_files(folder)
    base, head = next(((b, h) for b, h in PREFIXES if f"{b}embed_tokens.weight" in files), PREFIXES[0])
    names = {NORM: f"{base}norm.weight", EMBED: f"{base}embed_tokens.weight", HEAD: f"{head}{HEAD}"}
    tied = names[HEAD] not in files
    if tied and not (cfg.get("tie_word_embeddings") or lm_fields(cfg).get("tie_word_embeddings")):
        raise EaglepipeError(f"{folder}: no {names[HEAD]} and tie_word_embeddings is false; the target folder is "
                             "incomplete")
    out = {}
    for key in (NORM, EMBED) + (() if tied else (HEAD,)):
        if names[key] not in files:
            raise EaglepipeError(f"{folder}: tensor {names[key]!r} missing; expected a Llama-family HF checkpoint")
        with safe_open(files[names[key]], "pt") as f:
            out[key] = f.get_tensor(names[key]).float()
    embed = out[EMBED]
    return TargetHead(
        norm_weight=out[NORM],
        eps=float(lm_fields(cfg).get("rms_norm_eps", 1e-6)),
        lm_head=embed if tied else out[HEAD],
        embed=embed,
        tied=tied,
    )

