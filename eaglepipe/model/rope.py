"""The draft's RoPE is the target's RoPE: one resolved ``rope_parameters`` dict, computed by transformers.

A draft trained with one RoPE and served with another accepts little and fails silently (NeMo AutoModel
PR #2399), so the target's RoPE (type, theta and scaling) is read once, standardized by transformers'
own config code, and then used unchanged by training (:mod:`eaglepipe.model.draft`), the reference decoder
(:mod:`eaglepipe.serving.specdec`, through the same draft module) and the exported ``config.json``
(:mod:`eaglepipe.serving.export`). The frequencies come from transformers' ``ROPE_INIT_FUNCTIONS`` (and
``LlamaRotaryEmbedding.compute_default_rope_parameters`` for "default"), never from a hand copy; yarn's
attention scaling (``attention_factor``, or mscale / mscale_all_dim) is the second value they return.

Types the draft accepts are those both engines' ``LlamaForCausalLMEagle3`` drafts build a rotary embedding
for from ``rope_parameters`` (vllm 0.32 ``model_executor/layers/rotary_embedding/__init__.py get_rope``;
sglang 0.5.23 ``srt/layers/rotary_embedding/factory.py get_rope``) and transformers computes the same way:
default, linear, dynamic, llama3, yarn. Where the engines read them: vLLM's ``llama.py
LlamaAttention._init_rotary_emb`` passes ``config.rope_parameters``; SGLang's ``llama.py
LlamaDecoderLayer.__init__`` reads ``config.rope_parameters`` (theta inside it), falling back to
``rope_scaling`` + ``rope_theta``. Both receive the config through transformers, which standardizes
legacy ``rope_scaling`` into ``rope_parameters``; the export writes both spellings.

Dynamic NTK: within ``max_position_embeddings`` transformers, vLLM (``dynamic_ntk_scaling_rope.py``,
``max_trained_positions`` defaults to max_position) and SGLang all give plain RoPE; beyond it transformers
grows the base per sequence length, the engines do not. The draft follows the engines (no growth).
"""

from __future__ import annotations

import copy

from eaglepipe.errors import ParamsError

# rope_type -> why it is accepted (the engine functions that implement it for a Llama draft).
SUPPORTED = ("default", "linear", "dynamic", "llama3", "yarn")


class RopeError(ParamsError):
    """The target's RoPE is one the EAGLE-3 Llama draft cannot reproduce in both engines (a target problem)."""


def _text_config(target_cfg: dict) -> dict:
    sub = target_cfg.get("text_config")
    return sub if isinstance(sub, dict) and "num_hidden_layers" in sub else target_cfg


def _llama_config(cfg: dict, rope_parameters: dict | None = None):
    """A transformers ``LlamaConfig`` carrying ``cfg``'s attention shape and RoPE fields (standardized)."""
    from transformers import LlamaConfig

    nh = int(cfg["num_attention_heads"])
    kw = {
        "hidden_size": int(cfg["hidden_size"]),
        "num_attention_heads": nh,
        "head_dim": int(cfg.get("head_dim") or int(cfg["hidden_size"]) // nh),
        "max_position_embeddings": int(cfg.get("max_position_embeddings") or 8192),
    }
    if rope_parameters is not None:
        kw["rope_parameters"] = copy.deepcopy(rope_parameters)
    else:
        if cfg.get("rope_parameters"):
            kw["rope_parameters"] = copy.deepcopy(cfg["rope_parameters"])
        elif cfg.get("rope_scaling"):
            kw["rope_scaling"] = copy.deepcopy(cfg["rope_scaling"])
        if cfg.get("rope_theta") is not None:
            kw["rope_theta"] = float(cfg["rope_theta"])
    return LlamaConfig(**kw)


def rope_parameters(target_cfg: dict) -> dict:
    """The target's RoPE as transformers standardizes it: ``{"rope_type", "rope_theta", ...scaling keys}``.

    Args:
        target_cfg: the target's HF ``config.json`` dict (``rope_parameters``, or legacy ``rope_scaling`` +
            ``rope_theta``; multimodal wrappers through ``text_config``).
    Raises:
        RopeError: a rope type outside :data:`SUPPORTED`, a ``partial_rotary_factor`` ≠ 1 (the draft
            rotates the whole head), or per-layer-type (nested) RoPE, each with the reason.
    """
    cfg = _text_config(target_cfg)
    raw = cfg.get("rope_parameters")
    if isinstance(raw, dict) and raw and all(isinstance(v, dict) for v in raw.values()):
        raise RopeError(
            f"target model_type {cfg.get('model_type')!r} has one RoPE per layer type ({sorted(raw)}); the "
            "EAGLE-3 Llama draft has one attention layer and both engines build it one rotary embedding "
            "(vllm llama.py _init_rotary_emb, sglang llama.py LlamaDecoderLayer)"
        )
    params = dict(_llama_config(cfg).rope_parameters)
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED:
        raise RopeError(
            f"target rope_type {rope_type!r}: the EAGLE-3 draft supports {list(SUPPORTED)} (the types both "
            "vllm rotary_embedding/__init__.py get_rope and sglang rotary_embedding/factory.py get_rope build "
            "for a LlamaForCausalLMEagle3 draft and transformers computes alike); use a target whose "
            "rope_parameters.rope_type is one of them"
        )
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
    if partial != 1.0:
        raise RopeError(
            f"target partial_rotary_factor {partial}: the draft rotates the whole head (eaglepipe/model/draft.py "
            "apply_rope); partial rotary targets are not supported"
        )
    params.pop("partial_rotary_factor", None)
    params.pop("type", None)  # legacy spelling of rope_type, already copied into it
    return params


def inv_freq_and_scaling(
    rope: dict, head_dim: int, hidden_size: int, num_attention_heads: int, max_position_embeddings: int
) -> tuple["torch.Tensor", float]:  # noqa: F821
    """transformers' inverse frequencies and attention scaling for ``rope`` (from :func:`rope_parameters`).

    Returns:
        inv_freq: (head_dim/2,) float32, the per-pair rotation speed (ROPE_INIT_FUNCTIONS[rope_type]).
        scaling: float multiplying cos and sin (1.0 except yarn's attention factor, and longrope's).
    Raises:
        RopeError: ``rope["rope_type"]`` outside :data:`SUPPORTED`.
    """
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED:
        raise RopeError(f"rope_type {rope_type!r} is not one of {list(SUPPORTED)}")
    cfg = _llama_config({"hidden_size": hidden_size, "num_attention_heads": num_attention_heads,
                         "head_dim": head_dim, "max_position_embeddings": max_position_embeddings}, rope)
    fn = LlamaRotaryEmbedding.compute_default_rope_parameters if rope_type == "default" \
        else ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = fn(cfg, device=torch.device("cpu"))
    return inv_freq.float(), float(scaling)  # (head_dim/2,)


def engine_fields(rope: dict) -> dict:
    """The RoPE fields of an exported draft ``config.json``, in every spelling the engines read.

    ``rope_parameters`` (theta inside; vllm 0.32 llama.py and sglang 0.5.23 llama.py read it through
    transformers ≥ 5), ``rope_theta`` (top level: sglang's fallback and transformers 4 readers) and
    ``rope_scaling`` (the scaling dict without theta for transformers 4 era readers; None for "default").
    """
    rope = dict(rope)
    scaling = None
    if rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_theta": float(rope["rope_theta"]), "rope_parameters": rope, "rope_scaling": scaling}
