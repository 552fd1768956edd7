"""A draft folder in any EAGLE-3 serving format, rebuilt as an :class:`Eagle3Draft` the way vLLM reads it.

Formats (:func:`eaglepipe.contract.inspect.detect_format`): eaglepipe's exports and SpecForge/SGLang folders
(``LlamaForCausalLMEagle3``: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), ModelOpt's (the same
names), speculators' (llama fields in ``transformer_layer_config``, the layer as ``layers.0.*``). Tensor names
follow vllm 0.32 ``model_executor/models/llama_eagle3.py``: ``midlayer.`` and ``layers.0.`` name the same layer
(its ``hf_to_vllm_mapper``), a ``model.`` prefix is dropped, the target's ``embed_tokens`` is shared and skipped,
a missing ``d2t`` means the identity vocabulary. The EAGLE-3.1 flags are read as vLLM reads them (speculators:
``norm_before_residual`` on unless the config says otherwise, ``transformers_utils/configs/speculators/algos.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from eaglepipe.contract import variants
from eaglepipe.contract.inspect import detect_format, vllm_view
from eaglepipe.errors import EaglepipeError
from eaglepipe.model.draft import DraftConfig, Eagle3Draft
from eaglepipe.model.rope import rope_parameters
from eaglepipe.target.config import lm_fields, read_json


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``*.safetensors`` under the draft's own names (module docstring); the target's
    ``embed_tokens`` left out. Raises EaglepipeError when the folder holds no safetensors file."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise EaglepipeError(f"{folder}: no *.safetensors file (a draft folder holds its weights as safetensors)")
    out = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
            if not name.endswith("embed_tokens.weight"):
                out[name] = t
    return out


def folder_config(cfg: dict, tensors: dict[str, torch.Tensor], target_cfg: dict) -> DraftConfig:
    """The :class:`DraftConfig` of a draft ``config.json`` dict and its tensors, on the target ``target_cfg``: the
    llama fields vLLM builds (:func:`vllm_view`), ``n_aux`` = fc width / the target's hidden size, the draft
    vocabulary from ``lm_head``. Raises EaglepipeError when fc or lm_head is missing or fc's width is not a
    multiple of the target's hidden size."""
    view, lm = vllm_view(cfg, detect_format(cfg)), lm_fields(target_cfg)
    if "fc.weight" not in tensors or "lm_head.weight" not in tensors:
        raise EaglepipeError(f"draft weights lack fc.weight or lm_head.weight (found {sorted(tensors)[:8]} …)")
    ht, width = int(lm["hidden_size"]), tensors["fc.weight"].shape[1]
    if width % ht:
        raise EaglepipeError(f"fc.weight reads {width} features, not a multiple of the target's hidden size {ht}")
    h, nh = int(view["hidden_size"]), int(view["num_attention_heads"])
    rope = rope_parameters(view)
    return DraftConfig(
        hidden_size=h, num_attention_heads=nh, num_key_value_heads=int(view.get("num_key_value_heads") or nh),
        head_dim=int(view.get("head_dim") or h // nh), intermediate_size=int(view["intermediate_size"]),
        rms_norm_eps=float(view.get("rms_norm_eps", 1e-6)), rope_theta=float(rope["rope_theta"]),
        max_position_embeddings=int(view.get("max_position_embeddings", 8192)), target_hidden_size=ht,
        n_aux=width // ht, draft_vocab_size=tensors["lm_head.weight"].shape[0], vocab_size=int(lm["vocab_size"]),
        rope_parameters=rope, **dict.fromkeys(variants.config_flags(view), True),
    )


def load_draft_folder(folder: str | Path, target_cfg: dict, device: str | torch.device = "cpu") -> Eagle3Draft:
    """The draft of a serving-format folder (module docstring) in float32, eval mode, on ``device``.

    Raises EaglepipeError: config.json or weights missing, a tensor missing or unexpected for the config's
    variant (named), no ``d2t`` with a draft vocabulary smaller than the target's.
    """
    draft_dir = Path(folder)
    cfg = read_json(draft_dir / "config.json")
    tensors = folder_tensors(draft_dir)
    dcfg = folder_config(cfg, tensors, target_cfg)
    if "d2t" not in tensors:
        if dcfg.draft_vocab_size != dcfg.vocab_size:
            raise EaglepipeError(f"{draft_dir}: no d2t, but lm_head has {dcfg.draft_vocab_size} rows and the target "
                                 f"vocabulary {dcfg.vocab_size}: which target token a draft id means is unknown")
        tensors["d2t"] = torch.zeros(dcfg.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in tensors:
        tensors["t2d"] = torch.zeros(dcfg.vocab_size, dtype=torch.bool)
        tensors["t2d"][torch.arange(dcfg.draft_vocab_size) + tensors["d2t"]] = True
    draft = Eagle3Draft(dcfg)
    missing, unexpected = draft.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                 for k, v in tensors.items()}, strict=False)
    if missing or unexpected:
        raise EaglepipeError(f"{draft_dir}: the weights do not fit an EAGLE-3 draft with norms {dcfg.norms}: "
                             f"missing {missing}, unexpected {unexpected}")
    return draft.to(device).eval()
