"""The EAGLE-3 draft model: ``fc`` over the target's aux states, one Llama decoder layer over
[embedding ; hidden], a final norm and an ``lm_head`` over a draft vocabulary.

Parameter and buffer names are exactly what SGLang and vLLM load for ``LlamaForCausalLMEagle3``
(sglang ``srt/models/llama_eagle3.py``, vllm ``model_executor/models/llama_eagle3.py``)::

    fc.weight                                   (H, L·Ht)   no bias (both engines: bias=False)
    midlayer.hidden_norm.weight                 (H,)
    midlayer.input_layernorm.weight             (H,)
    midlayer.self_attn.q_proj.weight            (nh·hd, 2H)  (k/v: (nkv·hd, 2H); q/k/v read 2H)
    midlayer.self_attn.o_proj.weight            (H, nh·hd)
    midlayer.post_attention_layernorm.weight    (H,)
    midlayer.mlp.{gate,up}_proj.weight          (I, H)       (down: (H, I))
    norm.weight                                 (H,)
    lm_head.weight                              (Vd, H)
    d2t  int64 (Vd,)  offsets: target id = draft id + d2t[draft id]
    t2d  bool  (V,)   t2d[target id] = token is in the draft vocabulary

The target's ``embed_tokens`` is frozen and shared: it is passed in, never a parameter of this module, never
saved. The decoder layer, as both engines run it (their fused add-norm written out)::

    residual = hidden                                         # fc(aux) at step 0, own pre-norm output later
    x   = cat[input_layernorm(embed(token)), hidden_norm(hidden)]          # (B, T, 2H), embedding FIRST
    h   = residual + o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))         # (B, T, H)
    out = h + mlp(post_attention_layernorm(h))                              # (B, T, H)  pre-norm output
    logits = lm_head(norm(out))                                             # (B, T, Vd)

``out`` (before ``norm``) is what both engines feed back as the next draft step's ``hidden``: SGLang returns
``hidden_states_to_aux`` from its fused ``norm(hidden, residual)``, vLLM returns ``hidden_prenorm``.

EAGLE-3.1 variants (``DraftConfig`` flags; which engine reads which: :mod:`eaglepipe.contract.variants`), as
vllm's ``llama_eagle3.py`` computes them:

    norm_before_fc        fc(input_norm(cat_l aux_l)), ``input_norm.weight`` (L·Ht,)     ``combine_hidden_states``
    fc_norm               fc(cat_l fc_norm[l](aux_l)), ``fc_norm.{l}.weight`` (Ht,) each  (exclusive with the above)
    norm_before_residual  residual = hidden_norm(hidden) instead of hidden                ``_norm_before_residual``
    norm_output           norm(out), not out, feeds the next draft step                   ``aux_output``

Shapes: B batch, T tokens, L aux layers, Ht target hidden, H draft hidden (= the target's, embeddings are
shared), nh / nkv query / key-value heads, hd head dim, I intermediate size, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from eaglepipe.contract.variants import KEYS as NORMS
from eaglepipe.contract.variants import combination_problem
from eaglepipe.errors import EaglepipeError
from eaglepipe.model.rope import inv_freq_and_scaling, rope_parameters
from eaglepipe.target.config import lm_fields

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class DraftConfig:
    """Everything that shapes the draft; built from the target's HF ``config.json``."""

    hidden_size: int  # H: the draft's width = the target's (the embeddings are shared)
    num_attention_heads: int  # nh, as the target
    num_key_value_heads: int  # nkv, as the target (GQA)
    head_dim: int  # hd, as the target
    intermediate_size: int  # I of the draft MLP: the target's unless train.draft_intermediate_size says otherwise
    rms_norm_eps: float  # as the target
    rope_theta: float  # as the target (also inside rope_parameters)
    max_position_embeddings: int  # as the target
    target_hidden_size: int  # Ht, width of each aux state
    n_aux: int  # L = len(layers); fc reads L·Ht
    draft_vocab_size: int  # Vd
    vocab_size: int  # V, the target's vocabulary (t2d length, embedding rows)
    hidden_act: str = "silu"  # the MLP activation; only silu is implemented
    # the target's RoPE, standardized by transformers (eaglepipe/model/rope.py); None = plain RoPE at rope_theta
    rope_parameters: dict | None = None
    norm_before_fc: bool = False  # EAGLE-3.1 variants (module docstring); False: the plain EAGLE-3 draft
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False

    def __post_init__(self):
        if (why := combination_problem(self.norms)) is not None:
            raise EaglepipeError(f"draft norms {why}")

    @classmethod
    def from_target(cls, target: dict, n_aux: int, draft_vocab_size: int,
                    intermediate_size: int = 0, norms: list[str] = ()) -> "DraftConfig":
        """Build from the target's ``config.json`` dict (a wrapper's ``text_config``); ``intermediate_size`` > 0 widens
        (or narrows) the draft's MLP, 0 keeps the target's; ``norms``: the EAGLE-3.1 flags switched on (module
        docstring). Raises EaglepipeError on what the draft cannot mirror."""
        rope = rope_parameters(target)  # raises RopeError for what the engines' Llama drafts cannot build
        target = lm_fields(target)  # a multimodal wrapper's language model
        if target.get("hidden_act", "silu") != "silu":
            raise EaglepipeError(f"target hidden_act {target['hidden_act']!r}: the draft MLP implements silu only")
        nh = int(target["num_attention_heads"])
        h = int(target["hidden_size"])
        vocab = int(target["vocab_size"])
        return cls(
            hidden_size=h,
            num_attention_heads=nh,
            num_key_value_heads=int(target.get("num_key_value_heads") or nh),
            head_dim=int(target.get("head_dim") or h // nh),
            intermediate_size=int(intermediate_size or target["intermediate_size"]),
            rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]),
            max_position_embeddings=int(target.get("max_position_embeddings", 8192)),
            target_hidden_size=h,
            n_aux=n_aux,
            draft_vocab_size=min(draft_vocab_size, vocab),
            vocab_size=vocab,
            rope_parameters=rope,
            **{flag: True for flag in norms},
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def norms(self) -> list[str]:
        """The EAGLE-3.1 flags switched on, in :data:`eaglepipe.contract.variants.KEYS` order ([] = EAGLE-3)."""
        return [k for k in NORMS if getattr(self, k)]

    @property
    def rope(self) -> dict:
        """The resolved RoPE: ``rope_parameters`` with ``rope_type``, and ``rope_theta`` from its own field."""
        return {**(self.rope_parameters or {"rope_type": "default"}), "rope_theta": self.rope_theta}


class RMSNorm(nn.Module):
    """Llama RMSNorm; the reduction runs in fp32 whatever the input dtype (as HF and the engines do)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., D) fp32
        return self.weight * xf.to(x.dtype)  # (..., D)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) int64 → cos, sin (B, 1, T, hd) in fp32 (the rotate-half layout of HF Llama).

    ``inv_freq`` (hd/2,) and ``scaling`` (yarn's attention factor, else 1.0) come from
    :func:`eaglepipe.model.rope.inv_freq_and_scaling`, as ``LlamaRotaryEmbedding.forward`` uses them.
    """
    freqs = positions.float()[..., None] * inv_freq  # (B, T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, hd)
    return (emb.cos() * scaling)[:, None], (emb.sin() * scaling)[:, None]  # (B, 1, T, hd) each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, n, T, hd) rotated by position; same shape and dtype."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, n, T, hd/2) each
    rotated = torch.cat([-x2, x1], dim=-1)  # (B, n, T, hd)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)  # (B, n, T, hd)


# attend(q (B, nh, T, hd), k (B, nkv, T, hd), v (B, nkv, T, hd)) -> (B, nh, T, hd): decides which keys each
# query sees. Training passes the TTT attention (eaglepipe/train/ttt/attention.py), inference a KV cache
# (KVCache.attend).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    """GQA attention whose q/k/v read the 2H-wide [embedding ; hidden] input."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        B, T, _ = x.shape  # x: (B, T, 2H)
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (B, nh|nkv, T, hd)
        y = attend(q, k, v)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.nh * self.hd)  # (B, T, nh·hd)
        return self.o_proj(y)  # (B, T, H)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, I) → (B, T, H)


class MidLayer(nn.Module):
    """The one decoder layer; returns its pre-norm output (the residual stream after attention and MLP)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, emb, hidden, cos, sin, attend: Attend) -> torch.Tensor:
        normed = self.hidden_norm(hidden)  # (B, T, H)
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)  # (B, T, 2H)
        h = (normed if self.norm_before_residual else hidden) + self.self_attn(x, cos, sin, attend)  # (B, T, H)
        return h + self.mlp(self.post_attention_layernorm(h))  # (B, T, H) pre-norm output


class Eagle3Draft(nn.Module):
    """The draft. ``state_dict()`` holds exactly the exported names (see the module docstring)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.mask_buffers: dict | None = None  # set by compile_draft under CUDA graphs (ttt/attention.py)
        width = cfg.n_aux * cfg.target_hidden_size
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(width, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.n_aux))
        self.fc = nn.Linear(width, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # (Vd,)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True  # identity vocabulary until set_vocab
        self.register_buffer("t2d", t2d)  # (V,)
        inv_freq, self.rope_scaling = inv_freq_and_scaling(
            cfg.rope, cfg.head_dim, cfg.hidden_size, cfg.num_attention_heads, cfg.max_position_embeddings
        )  # (hd/2,), float: transformers' ROPE_INIT_FUNCTIONS for the target's rope_type
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary (see vocab.py)."""
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux (B, T, L, Ht), L in ascending boundary order → fc(cat_l aux[..., l, :]) (B, T, H), the aux states
        normalized first where the config says so (norm_before_fc: together, fc_norm: each)."""
        if self.cfg.fc_norm:
            aux = torch.stack([norm(aux[..., i, :]) for i, norm in enumerate(self.fc_norm)], dim=-2)  # (B, T, L, Ht)
        x = aux.flatten(-2)  # (B, T, L·Ht)
        return self.fc(self.input_norm(x) if self.cfg.norm_before_fc else x)  # (B, T, H)

    def feed(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's pre-norm output (B, T, H) → the ``hidden`` of the next draft step (B, T, H): ``out`` itself,
        or ``norm(out)`` with norm_output (vllm ``llama_eagle3.py`` ``aux_output``)."""
        return self.norm(out) if self.cfg.norm_output else out

    def layer(self, emb, hidden, positions, attend: Attend) -> torch.Tensor:
        """emb (B, T, H) embedding of the token each position reads, hidden (B, T, H), positions (B, T)
        → pre-norm output (B, T, H)."""
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scaling)  # (B, 1, T, hd)
        return self.midlayer(emb, hidden, cos, sin, attend)  # (B, T, H)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm output (B, T, H) → draft-vocab logits (B, T, Vd)."""
        return self.lm_head(self.norm(out))  # (B, T, Vd)

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits (..., Vd) → (..., V): scattered to target ids through d2t, -inf elsewhere (as vLLM)."""
        ids = torch.arange(self.cfg.draft_vocab_size, device=logits.device) + self.d2t  # (Vd,) target ids
        full = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))  # (..., V)
        full[..., ids] = logits
        return full


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, nkv, S, hd) → (B, nkv·n_rep, S, hd): each key/value head serves n_rep query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


@dataclass
class KVCache:
    """Inference cache of the draft's one layer: keys/values of every position drafted or extended so far.

    k, v: (B, nkv, S, hd). ``attend`` appends the new keys and lets new query i see cached keys 0..S-1 and new
    keys 0..i (causal). ``crop(n)`` keeps the first n entries (drop rejected drafts).
    """

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        S, T = len(self), q.shape[2]
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)  # (B, nkv, S+T, hd)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)  # (B, nkv, S+T, hd)
        n_rep = q.shape[1] // k.shape[1]
        i = torch.arange(T, device=q.device)[:, None]  # (T, 1)
        j = torch.arange(S + T, device=q.device)[None, :]  # (1, S+T)
        mask = j <= S + i  # (T, S+T) causal over cache + new
        return F.scaled_dot_product_attention(
            q, repeat_kv(self.k, n_rep).to(q.dtype), repeat_kv(self.v, n_rep).to(q.dtype), attn_mask=mask
        )  # (B, nh, T, hd)

    def crop(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


@dataclass
class DraftStep:
    logits: torch.Tensor  # (B, T, V) in TARGET id space, -inf outside the draft vocabulary
    hidden: torch.Tensor  # (B, T, H) the ``hidden`` of the next draft step (Eagle3Draft.feed of the output)


def draft_step(
    draft: Eagle3Draft,
    embed_tokens: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache: KVCache,
    aux: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
) -> DraftStep:
    """One draft forward, as a speculative decoder calls it.

    Args:
        embed_tokens: (V, H) the target's embedding matrix (shared, frozen).
        input_ids: (B, T) target ids; position t reads token x[t+1] (see ttt/unroll.py: "align (x1, g0)").
        positions: (B, T) int64 RoPE positions (t for the pair (g_t, x_{t+1}); +1 per drafted token).
        cache: the draft's KVCache, extended in place.
        aux: (B, T, L, Ht) target aux states g_t (after a target forward), or
        hidden: (B, T, H) the previous draft step's ``DraftStep.hidden`` (while drafting). Exactly one.
    """
    if (aux is None) == (hidden is None):
        raise ValueError("draft_step takes exactly one of aux (target states) or hidden (own previous output)")
    h = draft.project(aux) if aux is not None else hidden  # (B, T, H)
    emb = F.embedding(input_ids, embed_tokens).to(h.dtype)  # (B, T, H)
    out = draft.layer(emb, h, positions, cache.attend)  # (B, T, H)
    return DraftStep(logits=draft.to_target_vocab(draft.logits(out)), hidden=draft.feed(out))


def save_draft(draft: Eagle3Draft, folder: Path, extra: dict | None = None) -> None:
    """Write ``config.json`` (the DraftConfig + ``extra``) and ``model.safetensors`` (exported names)."""
    from safetensors.torch import save_file

    from eaglepipe.atomic import atomic_path, atomic_write_json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous() for name, t in draft.state_dict().items()}
    with atomic_path(folder / WEIGHTS_FILE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_json(folder / CONFIG_FILE, {"draft": draft.cfg.to_dict(), **(extra or {})})


def load_draft(folder: Path, device: str | torch.device = "cpu") -> Eagle3Draft:
    """Rebuild the draft saved by :func:`save_draft` (strict: every tensor present, none unexpected)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = DraftConfig(**json.loads((folder / CONFIG_FILE).read_text())["draft"])
    draft = Eagle3Draft(cfg)
    draft.load_state_dict(load_file(str(folder / WEIGHTS_FILE)), strict=True)
    return draft.to(device).eval()


def n_params(module: nn.Module) -> int:
    return sum(param.numel() for param in module.parameters())

