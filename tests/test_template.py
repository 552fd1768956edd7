"""Loss mask over predictions, on the real SmolLM2 chat template (exact tables)."""

import torch

from eaglepipe.data.template import generation_prompt, tokenize_conversation


def test_hi_hello_there_mask(tok):
    """user "Hi" / assistant "Hello there": the first assistant token is predicted (mask 1 at the header's '\\n')."""
    t = tokenize_conversation(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}], 512)
    tail = [tok.decode([i]) for i in t.input_ids[-8:].tolist()]
    assert tail == ["<|im_start|>", "ass", "istant", "\n", "Hello", " there", "<|im_end|>", "\n"]
    assert t.assistant[-8:].tolist() == [False, False, False, False, True, True, True, False]
    #                                      predicts: ass    istant  \n    Hello  there  <im_end> \n   (none)
    assert t.loss_mask[-8:].tolist() == [False, False, False, True, True, True, False, False]
    assert int(t.loss_mask.sum()) == 3 and len(t.input_ids) == 35  # the default system prompt is 21 tokens


def test_two_turns_and_system(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"},
        {"role": "user", "content": "Again"}, {"role": "assistant", "content": "No"},
    ]
    t = tokenize_conversation(tok, msgs, 512)
    words = [tok.decode([i]) for i in t.input_ids.tolist()]
    assistant_words = [w for w, a in zip(words, t.assistant.tolist()) if a]
    assert assistant_words == ["Yes", "<|im_end|>", "No", "<|im_end|>"]
    predicted = [words[i + 1] for i, m in enumerate(t.loss_mask.tolist()) if m]
    assert predicted == ["Yes", "<|im_end|>", "No", "<|im_end|>"]
    assert not t.loss_mask[-1]


def test_truncation_and_generation_prompt(tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    t = tokenize_conversation(tok, msgs, 31)
    # cut right after the assistant header: the next token ("Hello") is gone, so nothing is left to predict
    assert len(t.input_ids) == 31 and int(t.loss_mask.sum()) == 0
    full = tokenize_conversation(tok, msgs, 512)
    torch.testing.assert_close(t.input_ids, full.input_ids[:31])
    assert generation_prompt(tok, msgs[:1]) == full.input_ids[:31].tolist()
