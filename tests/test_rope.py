"""The draft's RoPE is the target's: cos/sin equal the target model's own transformers rotary embedding and
vLLM's get_rope for every accepted type; the export writes it in the fields the engines read; others refused."""

import json
import math

import pytest
import torch

from eaglepipe.errors import ParamsError
from eaglepipe.model.draft import DraftConfig, Eagle3Draft, rope_cos_sin
from eaglepipe.model.rope import RopeError, engine_fields, rope_parameters

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=99, max_position_embeddings=256)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 500000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1000000.0}
# (transformers config class, its rotary embedding, rope_parameters): each family's own RoPE code.
CASES = {
    "llama-default": ("LlamaConfig", "llama", {"rope_type": "default", "rope_theta": 100000.0}),
    "llama-linear": ("LlamaConfig", "llama", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "llama-dynamic": ("LlamaConfig", "llama", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "llama-llama3": ("LlamaConfig", "llama", LLAMA3),
    "qwen2-yarn": ("Qwen2Config", "qwen2", YARN),
    "gpt_oss-yarn": ("GptOssConfig", "gpt_oss", {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                  "beta_slow": 1.0, "truncate": False,
                                                  "original_max_position_embeddings": 8, "rope_theta": 150000.0}),
    "deepseek_v3-yarn": ("DeepseekV3Config", "deepseek_v3", {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32,
                                                              "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
                                                              "original_max_position_embeddings": 4,
                                                              "rope_theta": 10000.0}),
}


def _target(case):
    import importlib

    import transformers

    cls_name, module, rope = CASES[case]
    kw = dict(BASE, rope_parameters=dict(rope))
    if module == "gpt_oss":
        kw.update(head_dim=32, num_local_experts=2, num_experts_per_tok=1)
    if module == "deepseek_v3":
        kw.update(qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, kv_lora_rank=32, q_lora_rank=None,
                  n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=2)
    cfg = getattr(transformers, cls_name)(**kw)
    rotary_cls = [v for k, v in vars(importlib.import_module(f"transformers.models.{module}.modeling_{module}")).items()
                  if k.endswith("RotaryEmbedding")][0]
    return cfg, rotary_cls(cfg)


@pytest.mark.parametrize("case", sorted(CASES))
def test_draft_cos_sin_equal_the_targets_own_rotary_embedding(case):
    cfg, rotary = _target(case)
    target_dict = json.loads(cfg.to_json_string())  # what config.json holds
    dcfg = DraftConfig.from_target(target_dict, n_aux=3, draft_vocab_size=50)
    draft = Eagle3Draft(dcfg)
    pos = torch.arange(0, 200, 3)[None]  # (1, T): inside and beyond original_max_position_embeddings
    want_cos, want_sin = rotary(torch.zeros(1, pos.shape[1], 8), pos)  # (1, T, hd)
    cos, sin = rope_cos_sin(pos, draft.inv_freq, draft.rope_scaling)  # (1, 1, T, hd)
    assert cos.shape[-1] == dcfg.head_dim
    if want_cos.shape[-1] == dcfg.head_dim // 2:  # gpt_oss keeps one half (same neox rotation, not duplicated)
        cos, sin = cos[..., : dcfg.head_dim // 2], sin[..., : dcfg.head_dim // 2]
    torch.testing.assert_close(cos[:, 0], want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], want_sin, rtol=0, atol=1e-6)
    assert dcfg.rope["rope_type"] == CASES[case][2]["rope_type"]
    assert dcfg.rope["rope_theta"] == CASES[case][2]["rope_theta"]


def test_yarn_attention_scaling_is_applied():
    cfg, _ = _target("qwen2-yarn")
    draft = Eagle3Draft(DraftConfig.from_target(json.loads(cfg.to_json_string()), 3, 50))
    assert draft.rope_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)  # 1.1386
    cos, _ = rope_cos_sin(torch.zeros(1, 1, dtype=torch.long), draft.inv_freq, draft.rope_scaling)
    assert float(cos[0, 0, 0, 0]) == pytest.approx(1.1386294, abs=1e-6)  # cos(0) · attention factor


@pytest.mark.parametrize("case", sorted(CASES))
def test_vllm_get_rope_on_the_exported_fields_gives_the_drafts_cos_sin(case):
    """The real vLLM rotary embedding, built as its Llama draft builds it (llama.py _init_rotary_emb)."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    cfg, _ = _target(case)
    dcfg = DraftConfig.from_target(json.loads(cfg.to_json_string()), 3, 50)
    draft = Eagle3Draft(dcfg)
    fields = engine_fields(dcfg.rope)
    with set_current_vllm_config(VllmConfig()):
        emb = get_rope(dcfg.head_dim, max_position=dcfg.max_position_embeddings,
                       rope_parameters=fields["rope_parameters"], is_neox_style=True, dtype=torch.float32)
    T = 128
    cache = emb.cos_sin_cache[:T].float()  # (T, hd): [cos | sin] of the hd/2 frequencies
    cos, sin = rope_cos_sin(torch.arange(T)[None], draft.inv_freq, draft.rope_scaling)  # (1, 1, T, hd)
    half = dcfg.head_dim // 2
    torch.testing.assert_close(cache[:, :half], cos[0, 0, :, :half], rtol=0, atol=2e-6)
    torch.testing.assert_close(cache[:, half:], sin[0, 0, :, :half], rtol=0, atol=2e-6)


def test_export_fields_round_trip_through_transformers():
    """Engines load the draft config through transformers: the exported fields standardize to the same RoPE."""
    from transformers import LlamaConfig

    fields = engine_fields(dict(LLAMA3))
    assert fields["rope_theta"] == 500000.0
    assert fields["rope_scaling"] == {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    loaded = LlamaConfig(**BASE, **json.loads(json.dumps(fields)))
    assert loaded.rope_parameters == LLAMA3
    assert engine_fields({"rope_type": "default", "rope_theta": 1e4})["rope_scaling"] is None


def test_legacy_rope_scaling_is_read_like_rope_parameters():
    legacy = dict(BASE, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                  rope_theta=1000000.0)
    assert rope_parameters(legacy) == YARN


@pytest.mark.parametrize("rope,why", [
    ({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [1.0] * 16, "rope_theta": 1e4},
     "rope_type 'longrope'"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
])
def test_unsupported_rope_is_refused_with_the_reason(rope, why):
    with pytest.raises(RopeError, match=why) as e:
        DraftConfig.from_target(dict(BASE, rope_parameters=rope), 3, 50)
    assert isinstance(e.value, ParamsError)  # a target problem: exit code 2
