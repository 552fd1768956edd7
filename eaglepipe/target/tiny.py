"""Tiny random targets of the families the rules name and of some only the engines' own code decides (phi3, granite,
olmo2, qwen2_moe), saved as local HF folders (tests, support matrix).

Sizes are the smallest the real engines run on CPU: vLLM's CPU attention rejects head_dim 16, so head_dim is
32 (hidden 64, 2 heads); vLLM's CPU MLA needs kv_lora_rank + qk_rope_head_dim = 576 (512 + 64), and its CUDA
MLA prefill only DeepSeek's own head dims (qk_nope, qk_rope, v) = (128, 64, 128)
(vllm/v1/attention/backends/mla/prefill/flash_attn.py ``supports_mla_dimensions``); DeepSeek
configs say ``topk_method: noaux_tc`` (vLLM's DeepSeek MoE router). Their MoE routes top-2 of 4 experts in 2
groups, as real DeepSeek-V3 / Kimi-K2 checkpoints route top-k > 1 (8 of 256): SGLang 0.5.17's triton fused MoE
sums a never-written buffer for top-1 routing with a routed_scaling_factor other than 1
(``layers/moe/moe_runner/triton_utils/fused_moe.py _fused_moe_kernel_sequence``; sglang PR #40187), so a top-1
tiny target would measure that bug instead of the capture. Vocabulary: a character-level
tokenizer with ChatML specials and chat template (ids < 99).
"""

from __future__ import annotations

import string
from pathlib import Path

from eaglepipe.target.config import read_target_config, write_target_config

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Thinking templates of the real forms (eaglepipe/target/reasoning.py), over the tiny ChatML specials: Qwen3's
# hybrid template (its enable_thinking switch, reasoning split off an assistant message at </think>, kept for turns
# after the last user query, an empty think block written when off) and DeepSeek-V3.1's (its thinking switch:
# the generation prompt ends in <think> or </think>, earlier turns' reasoning dropped).
QWEN3 = (
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if m.role == 'user' and ns.last_query_index == messages|length - 1 %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- set content = m.content %}"
    "{%- if m.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n'"
    " + content.lstrip('\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}{{- '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}"
    "{%- endif %}{%- endif %}"
)
DEEPSEEK_V31 = (
    "{%- if thinking is not defined %}{%- set thinking = false %}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n</think>' + m.content.split('</think>')[-1] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' + ('<think>' if thinking else '</think>') }}"
    "{%- endif %}"
)
# gpt-oss's harmony template without tools: its reasoning_effort read into the system message, a system turn moved
# into a developer message, an assistant turn rendered as its final channel (its analysis, the "thinking" field, only
# for a last turn, which ends in <|return|>, earlier ones in <|end|>), the generation prompt <|start|>assistant. The
# system message keeps its date (strftime_now) and Reasoning lines (its identity and cutoff would fill a tiny
# character-level sample).
GPT_OSS = (
    "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}"
    "{{- '<|start|>system<|message|>' + strftime_now('%Y-%m-%d') + ' Reasoning: ' + reasoning_effort + '<|end|>' }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- '<|start|>developer<|message|>' + messages[0].content + '<|end|>' }}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for m in loop_messages %}{%- if m.role == 'assistant' %}"
    "{%- if loop.last and not add_generation_prompt %}"
    "{%- if 'thinking' in m %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}"
    "{%- endif %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' }}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- elif m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
HARMONY_SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
TEMPLATES = {"chatml": CHATML, "qwen3": QWEN3, "deepseek_v3.1": DEEPSEEK_V31, "harmony": GPT_OSS}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 1000000.0}
_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=99, max_position_embeddings=512, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
_MLA = dict(num_key_value_heads=2, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
            n_group=2, topk_group=2, topk_method="noaux_tc", n_shared_experts=1, moe_layer_freq=1, scoring_func="sigmoid", ep_size=1,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 128,
                             "rope_theta": 10000.0})

# name -> (transformers config class, extra kwargs, model_type written to config.json, rope_type)
FAMILIES: dict[str, tuple[str, dict, str | None, str]] = {
    "llama": ("LlamaConfig", dict(head_dim=32), None, "default"),
    "llama-llama3": ("LlamaConfig", dict(head_dim=32, rope_parameters=LLAMA3_ROPE), None, "llama3"),
    "qwen2": ("Qwen2Config", dict(), None, "default"),  # q/k/v carry a bias in Qwen2
    "qwen3": ("Qwen3Config", dict(head_dim=32), None, "default"),
    "mistral": ("MistralConfig", dict(head_dim=32, sliding_window=None), None, "default"),
    "gpt_oss": ("GptOssConfig", dict(head_dim=32, num_local_experts=2, num_experts_per_tok=1, sliding_window=16,
                                     layer_types=["sliding_attention", "full_attention"] * 3,
                                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                      "original_max_position_embeddings": 128}), None, "yarn"),
    "deepseek_v3": ("DeepseekV3Config", dict(_MLA), None, "yarn"),
    "kimi_k2": ("DeepseekV3Config", dict(_MLA), "kimi_k2", "yarn"),
    "qwen2-yarn": ("Qwen2Config", dict(rope_parameters=YARN_ROPE), None, "yarn"),
    # phi3, granite, olmo2: no rule names them, each engine's capture table decides (contract/capture_support.py)
    "phi3": ("Phi3Config", dict(), None, "default"),  # fused qkv_proj / gate_up_proj; both engines subclass Llama
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.03,
                                      logits_scaling=8.0), None, "default"),  # multipliers ≠ 1: h[k] scaled
    "olmo2": ("Olmo2Config", dict(), None, "default"),  # post-norm branches; vLLM runs it in its Transformers backend
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         decoder_sparse_step=1), None, "default"),
    # qwen2_moe: no rule names it; SGLang's qwen2_moe.py has Llama's id form (+1), vLLM's no capture
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32, decoder_sparse_step=1), None, "default"),
    # gemma3: refused by both serving engines' rules (and by eaglepipe: one RoPE per layer type)
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, sliding_window=16, query_pre_attn_scalar=32,
                                        layer_types=["sliding_attention"] * 5 + ["full_attention"]), None, "default"),
}


def tiny_tokenizer(template: str = "chatml"):
    """A character-level fast tokenizer (ids < 99) with ChatML specials and the chat template ``template`` (a key of
    :data:`TEMPLATES`); a thinking template's ``<think>`` and ``</think>`` are tokens of their own, not special (as in
    Qwen3); the harmony template's markers are special tokens (as in gpt-oss's o200k_harmony), ``<|return|>`` its
    EOS."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "[UNK]"]
    chars = string.ascii_letters + string.digits + " \n.,!?'-:"
    vocab = {t: i for i, t in enumerate(specials + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens(specials[:3])
    if "<think>" in TEMPLATES[template]:  # the reasoning markers, where a thinking template writes them
        tok.add_tokens(["<think>", "</think>"])
    if template == "harmony":
        tok.add_special_tokens(HARMONY_SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<|im_start|>",
        eos_token="<|return|>" if template == "harmony" else "<|im_end|>", unk_token="[UNK]",
        chat_template=TEMPLATES[template],
    )


def build(name: str, out: str | Path, seed: int = 0, template: str = "chatml", **overrides) -> Path:
    """Save the tiny random target ``name`` (a key of :data:`FAMILIES`) as an HF folder at ``out``.

    Weights are random (torch seed ``seed``), float32. For ``kimi_k2`` the folder's config.json then says
    ``model_type: kimi_k2`` (as Kimi-K2 checkpoints do), which transformers alone cannot load.
    ``overrides``: config keys over the family's (e.g. ``num_experts_per_tok=1`` for a variant); ``template``: the
    tokenizer's chat template (:func:`tiny_tokenizer`; the harmony template's ``<|return|>`` is the model's EOS).
    """
    import torch
    import transformers

    cls_name, extra, model_type, _ = FAMILIES[name]
    tok = tiny_tokenizer(template)
    if template == "harmony":
        overrides = {"eos_token_id": tok.eos_token_id, **overrides}
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls_name)(**{**_BASE, **extra, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if model_type is not None:
        raw = read_target_config(out)
        raw["model_type"] = model_type
        write_target_config(out, raw)
    return out


# Kimi-K2.5 as its hub checkpoint declares it: a KimiK25ForConditionalGeneration wrapper (model_type kimi_k25) whose
# text_config is a Kimi-K2 (DeepSeek-V3 with MLA) config, language-model weights under language_model.* (vLLM's
# kimi_k25.py hf_to_vllm_mapper and transformers' kimi_k25 conversion both read these names). The vision tower is
# configured tiny and left without weights: text-only engines do not build it (vLLM language_model_only) and
# transformers initializes it.
KIMI_K25_VISION = {"patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
                   "merge_kernel_size": [2, 2], "num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 32,
                   "intermediate_size": 64, "pos_emb_height": 8, "pos_emb_width": 8}
# vLLM's fused Kimi-K2.5 image processor reads media_proc_cfg from preprocessor_config.json
# (vllm/transformers_utils/processors/kimi_k25_vision_fused.py)
KIMI_K25_MEDIA = {"patch_size": 14, "merge_kernel_size": [2, 2], "temporal_merge_kernel_size": 4,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "in_patch_limit": 256,
                  "in_patch_limit_each_frame": 64, "in_patch_limit_video": 256, "patch_limit_on_one_side": 32,
                  "fixed_output_tokens": None}


def build_kimi_k25(out: str | Path, seed: int = 0, template: str = "chatml") -> Path:
    """Save a tiny random Kimi-K2.5-shaped wrapper at ``out``: the tiny ``kimi_k2`` target (:func:`build`, same
    ``seed``) as the language model of a ``KimiK25ForConditionalGeneration`` checkpoint (:data:`KIMI_K25_VISION`)."""
    import json
    import tempfile

    from safetensors.torch import load_file, save_file

    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        inner = build("kimi_k2", Path(tmp) / "lm", seed=seed, template=template)
        out.mkdir(parents=True, exist_ok=True)
        weights = load_file(inner / "model.safetensors")
        save_file({f"language_model.{k}": v.contiguous() for k, v in weights.items()}, out / "model.safetensors",
                  metadata={"format": "pt"})
        for f in inner.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (out / f.name).write_bytes(f.read_bytes())
        text = {k: v for k, v in read_target_config(inner).items() if k != "architectures"}
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    write_target_config(out, {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                              "text_config": text, "vision_config": KIMI_K25_VISION, "projection_hidden_size": 32,
                              "media_placeholder_token_id": 95, "image_token_id": 95, "video_token_id": 96,
                              "vision_start_token_id": 97, "vision_end_token_id": 98, "tie_word_embeddings": False,
                              **ids})
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": KIMI_K25_MEDIA}, indent=1))
    return out


def build_qwen2_5_vl(out: str | Path, seed: int = 0) -> Path:
    """Save a tiny random Qwen2.5-VL wrapper (``Qwen2_5_VLForConditionalGeneration``: its language model a tiny Qwen2
    with M-RoPE sections summing to head_dim / 2, a 2-block vision tower) at ``out``, with the tiny tokenizer plus
    Qwen's vision tokens and a Qwen2-VL image processor config."""
    import torch
    import transformers

    tok = tiny_tokenizer()
    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": vision})
    start, end, image, video = tok.convert_tokens_to_ids(vision)
    torch.manual_seed(seed)
    text = {**_BASE, "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0}}
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=text, tie_word_embeddings=False, vision_start_token_id=start, vision_end_token_id=end,
        image_token_id=image, video_token_id=video,
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1]))
    out = Path(out)
    transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(out)
    return out


def build_compressed(src: str | Path, out: str | Path, scheme: str = "W8A8", group_size: int = 32) -> Path:
    """Save the float target folder ``src`` quantized as a compressed-tensors checkpoint at ``out``, as llmcompressor
    saves one: compressed-tensors' preset ``scheme`` (``W8A8``: int8 channel weights, int8 dynamic token
    activations; ``FP8_DYNAMIC``; ``W4A16``: int4 weights in groups of ``group_size``) on every Linear but
    ``lm_head``, weight scales from each channel's (group's) min/max (``calculate_qparams``; dynamic activations
    need no calibration), compressed by ``ModelCompressor`` and its ``quantization_config`` written to config.json."""
    import torch
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    qscheme = preset_name_to_scheme(scheme, ["Linear"])
    if qscheme.weights.strategy == "group":
        qscheme.weights.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": qscheme}, ignore=["lm_head"]))
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        w = module.weight.data
        w = {"group": lambda: w.reshape(w.shape[0], -1, args.group_size), "tensor": lambda: w.reshape(1, 1, -1)}.get(
            args.strategy, lambda: w.unsqueeze(1))()  # (rows, groups, columns a scale covers)
        scale, zero = calculate_qparams(w.amin(dim=2), w.amax(dim=2), args)  # (out, groups)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                module.weight_zero_point.shape)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out = Path(out)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


WORDS = "the cat sat on a mat while birds sang over quiet hills and rivers ran far away".split()


def tiny_conversations(n: int, answer_words: int = 4, source: str = "test") -> list[dict]:
    """``n`` short user → assistant conversations from a 16-word vocabulary (deterministic), for tiny targets.

    Conversation i: a user turn of 3 + i % 4 words and an answer of ``answer_words`` + i % 3 words, shifted
    through :data:`WORDS`, so lengths and contents vary while every test and benchmark gets the same set.
    """
    out = []
    for i in range(n):
        q = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i % 4))
        a = " ".join(WORDS[(2 * i + j) % len(WORDS)] for j in range(answer_words + i % 3))
        out.append({"id": f"c{i}", "source": source, "messages": [{"role": "user", "content": q},
                                                                  {"role": "assistant", "content": a}]})
    return out
