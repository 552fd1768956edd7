"""The target as transformers builds it: a causal LM, or a multimodal wrapper around one.

A wrapper (Qwen2.5-VL, Kimi-K2.5, Gemma-3, Llama-4: a ``config.json`` with a ``text_config``) has no
``AutoModelForCausalLM`` class; transformers builds it as ``AutoModelForImageTextToText``
(``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``), whose ``model.language_model`` is the decoder (embeddings, N
layers, final norm) and whose ``lm_head`` is the head. eaglepipe's hf capture hooks that decoder's layers; text-only
inputs run it alone (Qwen2.5-VL's M-RoPE gives every text token the same position in its three sections, so
1-D positions are the same rotation).
"""

from __future__ import annotations

from pathlib import Path


def auto_class(config):
    """``AutoModelForCausalLM`` for a transformers config it maps, else ``AutoModelForImageTextToText`` for a
    multimodal wrapper it maps. Raises ValueError (transformers' message) for a config neither maps."""
    import transformers

    for name in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
        cls = getattr(transformers, name)
        if type(config) in cls._model_mapping:
            return cls
    return transformers.AutoModelForCausalLM  # raises its own "Unrecognized configuration class" on use


def load_model(target_dir: str | Path, dtype):
    """The target folder's model (weights, ``dtype`` a torch dtype) through :func:`auto_class`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir)
    return auto_class(config).from_pretrained(target_dir, config=config, dtype=dtype)


def decoder(model):
    """The module holding the decoder's ``embed_tokens``, ``layers`` (N of them) and ``norm``: ``model.model`` of a
    causal LM, ``model.model.language_model`` of a wrapper."""
    base = model.model
    return getattr(base, "language_model", base)
