"""SGLang capture where SGLang has no capture-only mode: a probe draft that makes EAGLE-3 itself capture.

SGLang 0.5.23 has a capture-only EAGLE-3 mode (server args ``enable_return_aux_hidden_states`` and
``return_aux_hidden_state_layer_ids``, srt/server_args.py); SGLang 0.5.17, the release that matches torch 2.11,
has neither (its ``ServerArgs`` dataclass refuses them). There the aux states come from
real EAGLE-3 serving: the target's ``set_eagle3_layers_to_capture`` receives the ids of the draft's
``eagle_config.eagle_aux_hidden_state_layer_ids`` (srt/model_executor/model_runner.py), the prefill runs in
``CaptureHiddenMode.FULL`` and, with ``enable_return_hidden_states`` and a request's
``return_hidden_states=True``, ``LogitsProcessor._get_hidden_states_to_store`` returns the packed aux states
``[T, len(ids)·H]`` per prefill chunk (srt/layers/logits_processor.py), which SGLang appends to
``meta_info["hidden_states"]`` (srt/managers/scheduler_components/batch_result_processor.py
``_append_prefill_hidden_states``). The ids pass through exactly the code that serves a real draft.

The probe is a draft of the right shapes for the target (random weights, identity draft vocab, fc reading
``len(ids)`` states): it exists only so SGLang captures those ids; what it drafts is never used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import torch


def has_capture_only_mode() -> bool:
    """Does the installed SGLang accept ``enable_return_aux_hidden_states`` (0.5.23: yes, 0.5.17: no)?

    Read from the server-argument sources (srt/server_args.py; 0.5.23 declares fields in srt/arg_groups/)
    without importing sglang (the calling process never imports it).
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return False
    srt = Path(list(spec.submodule_search_locations)[0]) / "srt"
    sources = [srt / "server_args.py", *sorted((srt / "arg_groups").glob("*.py"))]
    return any(f.is_file() and "enable_return_aux_hidden_states" in f.read_text() for f in sources)


def probe_draft(target_dir: Path, ids: list[int], work_dir: Path, dtype: str = "float32") -> Path:
    """Write (once per target and ids) a LlamaForCausalLMEagle3 folder that makes SGLang capture ``ids``.

    Returns the folder. Shapes follow the target's ``config.json`` (eaglepipe.model.draft.DraftConfig.from_target);
    ``num_aux_hidden_states`` = len(ids), so the draft's fc takes the packed states SGLang captures.
    """
    from safetensors.torch import save_file

    from eaglepipe.contract import draft_config
    from eaglepipe.model.draft import DraftConfig, Eagle3Draft
    from eaglepipe.serving.export import draft_config_json
    from eaglepipe.target.config import lm_fields, read_target_config

    text_cfg = lm_fields(read_target_config(target_dir))
    # keyed by the target's config (not its path): a folder rewritten with another model gets its own probe
    key = hashlib.sha256(json.dumps([text_cfg, list(ids), dtype], sort_keys=True).encode()).hexdigest()[:12]
    out = Path(work_dir) / f"probe-{key}"
    if (out / "config.json").exists():
        return out
    cfg = DraftConfig.from_target(text_cfg, n_aux=len(ids), draft_vocab_size=int(text_cfg["vocab_size"]))
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    tensors = {n: t.detach().to(getattr(torch, dtype)) if t.is_floating_point() else t.detach()
               for n, t in draft.state_dict().items()}
    config = draft_config_json(cfg, text_cfg, dtype)
    config["num_aux_hidden_states"] = len(ids)
    config["eagle_config"] = {draft_config.NESTED_FIELD.split(".")[1]: list(ids)}
    tmp = Path(str(out) + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return out


def capture_server_args(target_dir: Path, ids: list[int], work_dir: Path, dtype: str) -> dict:
    """Server arguments that make SGLang capture ``ids`` for every request with ``return_hidden_states``."""
    if has_capture_only_mode():
        return {"enable_return_aux_hidden_states": True, "speculative_algorithm": "EAGLE3",
                "return_aux_hidden_state_layer_ids": list(ids)}
    return {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": str(probe_draft(target_dir, ids, work_dir, dtype)),
        "speculative_num_steps": 1, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 2,
        "enable_return_hidden_states": True,
    }
