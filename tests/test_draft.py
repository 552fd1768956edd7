"""The draft model: exported names/shapes, config from the target, parity with a hand-written reference built on
HF's own RoPE / RMSNorm, KV-cache decoding equal to the full forward, save/load round trip."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from eaglepipe.model.draft import DraftConfig, Eagle3Draft, KVCache, draft_step, load_draft, save_draft
from eaglepipe.model.target_head import load_target_head
from eaglepipe.train.ttt import TTTAttention

torch.set_num_threads(1)


@pytest.fixture
def cfg(tiny_target):
    return DraftConfig.from_target(json.loads((tiny_target / "config.json").read_text()), n_aux=3, draft_vocab_size=50)


def _draft(cfg, seed=0):
    torch.manual_seed(seed)
    d = Eagle3Draft(cfg)
    with torch.no_grad():  # non-trivial norms so a swapped norm would show
        for n, p in d.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d


def test_config_from_target(cfg):
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 4, 2, 8)
    assert (cfg.intermediate_size, cfg.target_hidden_size, cfg.n_aux, cfg.vocab_size) == (64, 32, 3, 99)
    assert cfg.draft_vocab_size == 50 and cfg.rope_theta == 10000.0


def test_draft_mlp_width_is_a_draft_choice(tiny_target):
    """train.draft_intermediate_size > 0 sets the draft MLP's width; 0 keeps the target's (64 here)."""
    t = json.loads((tiny_target / "config.json").read_text())
    wide = DraftConfig.from_target(t, n_aux=3, draft_vocab_size=50, intermediate_size=160)
    assert wide.intermediate_size == 160
    assert DraftConfig.from_target(t, n_aux=3, draft_vocab_size=50, intermediate_size=0).intermediate_size == 64
    sd = Eagle3Draft(wide).state_dict()
    assert tuple(sd["midlayer.mlp.gate_proj.weight"].shape) == (160, 32)
    assert tuple(sd["midlayer.mlp.down_proj.weight"].shape) == (32, 160)


def test_exported_names_and_shapes(cfg):
    sd = Eagle3Draft(cfg).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == {
        "fc.weight": (32, 96),
        "midlayer.hidden_norm.weight": (32,),
        "midlayer.input_layernorm.weight": (32,),
        "midlayer.self_attn.q_proj.weight": (32, 64),
        "midlayer.self_attn.k_proj.weight": (16, 64),
        "midlayer.self_attn.v_proj.weight": (16, 64),
        "midlayer.self_attn.o_proj.weight": (32, 32),
        "midlayer.post_attention_layernorm.weight": (32,),
        "midlayer.mlp.gate_proj.weight": (64, 32),
        "midlayer.mlp.up_proj.weight": (64, 32),
        "midlayer.mlp.down_proj.weight": (32, 64),
        "norm.weight": (32,),
        "lm_head.weight": (50, 32),
        "d2t": (50,),
        "t2d": (99,),
    }
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool


def _reference_step(d: Eagle3Draft, cfg, embed, aux, ids):
    """One draft step written out by hand, with HF Llama's RMSNorm and RoPE (one sequence, causal), and the
    EAGLE-3.1 flags as vllm's llama_eagle3.py applies them; returns (the hidden fed to the next step, logits)."""
    sd = d.state_dict()

    def norm(name, x):
        n = LlamaRMSNorm(x.shape[-1], eps=cfg.rms_norm_eps)
        n.weight.data.copy_(sd[name])
        return n(x)

    T = ids.shape[1]
    a = aux.flatten(-2)  # (1, T, L·Ht)
    if cfg.norm_before_fc:
        a = norm("input_norm.weight", a)
    if cfg.fc_norm:
        a = torch.cat([norm(f"fc_norm.{i}.weight", c) for i, c in enumerate(a.chunk(cfg.n_aux, -1))], -1)
    g = a @ sd["fc.weight"].T  # (1, T, H)
    gn = norm("midlayer.hidden_norm.weight", g)
    x = torch.cat([norm("midlayer.input_layernorm.weight", embed[ids]), gn], -1)
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(1, T, 4, 8).transpose(1, 2)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(1, T, 2, 8).transpose(1, 2)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(1, T, 2, 8).transpose(1, 2)
    from transformers import LlamaConfig

    rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=32, num_attention_heads=4, rope_theta=cfg.rope_theta))
    cos, sin = rope(x, torch.arange(T)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    att = (q @ k.transpose(-1, -2)) / 8**0.5 + torch.full((T, T), float("-inf")).triu(1)
    y = (att.softmax(-1) @ v).transpose(1, 2).reshape(1, T, 32)
    h = (gn if cfg.norm_before_residual else g) + y @ sd["midlayer.self_attn.o_proj.weight"].T
    m = norm("midlayer.post_attention_layernorm.weight", h)
    mlp = (F.silu(m @ sd["midlayer.mlp.gate_proj.weight"].T) * (m @ sd["midlayer.mlp.up_proj.weight"].T))
    out = h + mlp @ sd["midlayer.mlp.down_proj.weight"].T
    normed = norm("norm.weight", out)
    return (normed if cfg.norm_output else out), normed @ sd["lm_head.weight"].T


def test_forward_matches_hand_written_reference(cfg, tiny_target):
    cfg = dataclasses.replace(cfg, rope_theta=100000.0)  # SmolLM2's theta, not the default
    d = _draft(cfg)
    embed = load_target_head(tiny_target).embed
    torch.manual_seed(1)
    aux, ids = torch.randn(1, 7, 3, 32), torch.randint(0, 99, (1, 7))
    ref_out, ref_logits = _reference_step(d, cfg, embed, aux, ids)
    r = draft_step(d, embed, ids, torch.arange(7)[None], KVCache(), aux=aux)
    torch.testing.assert_close(r.hidden, ref_out)
    torch.testing.assert_close(d.logits(r.hidden), ref_logits)
    # TTT step 0 is the same causal forward
    out = d.layer(F.embedding(ids, embed), d.project(aux), torch.arange(7)[None], TTTAttention(torch.zeros(1, 7)).attend)
    torch.testing.assert_close(out, ref_out)


def test_kv_cache_decoding_equals_full_forward(cfg):
    d = _draft(cfg)
    embed = torch.randn(99, 32)
    aux, ids = torch.randn(1, 6, 3, 32), torch.randint(0, 99, (1, 6))
    pos = torch.arange(6)[None]
    full = draft_step(d, embed, ids, pos, KVCache(), aux=aux)
    cache = KVCache()
    first = draft_step(d, embed, ids[:, :4], pos[:, :4], cache, aux=aux[:, :4])
    rest = [draft_step(d, embed, ids[:, t : t + 1], pos[:, t : t + 1], cache, aux=aux[:, t : t + 1]) for t in (4, 5)]
    got = torch.cat([first.hidden] + [r.hidden for r in rest], 1)
    torch.testing.assert_close(got, full.hidden)
    assert len(cache) == 6
    cache.crop(4)
    assert len(cache) == 4


def test_logits_land_on_target_ids_through_d2t(cfg):
    d = _draft(cfg)
    target_ids = torch.arange(50) * 2 - torch.arange(50) // 2  # some ascending ids < 99
    t2d = torch.zeros(99, dtype=torch.bool)
    t2d[target_ids] = True
    d.set_vocab(target_ids - torch.arange(50), t2d)
    logits = torch.randn(2, 3, 50)
    full = d.to_target_vocab(logits)
    assert full.shape == (2, 3, 99)
    torch.testing.assert_close(full[..., target_ids], logits)
    assert bool(torch.isinf(full[..., ~t2d]).all())


def test_save_load_round_trip(cfg, tmp_path):
    d = _draft(cfg)
    save_draft(d, tmp_path, extra={"layers": [1, 2, 3]})
    e = load_draft(tmp_path)
    for k, v in d.state_dict().items():
        torch.testing.assert_close(e.state_dict()[k], v)
    assert json.loads((tmp_path / "config.json").read_text())["layers"] == [1, 2, 3]


VARIANTS = [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_before_residual": True}, {"norm_output": True},
            {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}]  # the last: speculators'


@pytest.mark.parametrize("flags", VARIANTS, ids=lambda f: "+".join(f))
def test_eagle31_variants_match_the_hand_written_reference(cfg, tiny_target, flags, tmp_path):
    cfg = dataclasses.replace(cfg, **flags)
    d = _draft(cfg)
    names = set(d.state_dict())
    assert ("input_norm.weight" in names) == cfg.norm_before_fc
    assert ({"fc_norm.0.weight", "fc_norm.2.weight"} <= names) == cfg.fc_norm
    embed = load_target_head(tiny_target).embed
    torch.manual_seed(1)
    aux, ids = torch.randn(1, 7, 3, 32), torch.randint(0, 99, (1, 7))
    ref_next, ref_logits = _reference_step(d, cfg, embed, aux, ids)
    plain_next, _ = _reference_step(d, dataclasses.replace(cfg, **dict.fromkeys(flags, False)), embed, aux, ids)
    assert (ref_next - plain_next).abs().max() > 1e-3  # each flag changes the step
    r = draft_step(d, embed, ids, torch.arange(7)[None], KVCache(), aux=aux)
    torch.testing.assert_close(r.hidden, ref_next)
    torch.testing.assert_close(r.logits[..., :50], ref_logits)  # identity vocabulary: draft id = target id
    save_draft(d, tmp_path / "d")
    back = load_draft(tmp_path / "d")
    assert back.cfg == cfg and all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())


def test_the_two_fc_norms_are_exclusive(cfg):
    from eaglepipe.errors import EaglepipeError

    with pytest.raises(EaglepipeError, match="exclusive"):
        dataclasses.replace(cfg, norm_before_fc=True, fc_norm=True)
