"""Reasoning targets: the thinking switch found in the template, per-conversation modes, what the target wrote kept
as generated, reasoning and answer tokens counted, the loss mask with and without the reasoning, refusals; the
reference decoder's τ per thinking mode, inside the reasoning and the answer apart."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_extract import project, run_extract
from transformers import AutoTokenizer

from eaglepipe.data.features import FeatureSet
from eaglepipe.data.template import generation_prompt, tokenize_conversation, tokenize_generated
from eaglepipe.errors import ParamsError
from eaglepipe.model.draft import DraftConfig, Eagle3Draft, save_draft
from eaglepipe.params import load_params
from eaglepipe.serving.evaluate import (
    compact_serve_metrics,
    eval_prompts,
    reasoning_inside,
    reference_eval,
)
from eaglepipe.serving.specdec import split_rounds
from eaglepipe.target.reasoning import (
    harmony_message,
    no_switch_reason,
    reasoning_regions,
    template_kwargs,
    template_markers,
    thinking_on,
    thinking_switch,
)
from eaglepipe.target.tiny import CHATML, DEEPSEEK_V31, GPT_OSS, QWEN3, build, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
HI = [{"role": "user", "content": "hi"}]


def test_the_switch_is_the_variable_the_template_reads():
    assert thinking_switch(QWEN3) == "enable_thinking" and thinking_switch(DEEPSEEK_V31) == "thinking"
    assert thinking_switch(CHATML) is None and thinking_switch("{% if %}") is None  # no switch; no parse
    assert thinking_switch(GPT_OSS) == "reasoning_effort" and "jinja2.meta" in no_switch_reason(CHATML)
    assert template_kwargs("reasoning_effort", True, "low") == {"reasoning_effort": "low"}
    assert template_kwargs("reasoning_effort", None) == {} and template_kwargs("thinking", False, "low") == {
        "thinking": False}


def test_mix_draws_each_conversation_from_its_id_and_the_seed():
    draws = [thinking_on(f"c{i}", "mix", 0.5, 0) for i in range(400)]
    assert 170 <= sum(draws) <= 230  # a fair share, not a pattern of the ids
    assert draws == [thinking_on(f"c{i}", "mix", 0.5, 0) for i in range(400)]
    assert draws != [thinking_on(f"c{i}", "mix", 0.5, 1) for i in range(400)]
    assert [thinking_on("c0", m, 0.5, 0) for m in ("on", "off", "template")] == [True, False, None]
    assert not any(thinking_on(f"c{i}", "mix", 0.0, 0) for i in range(50))


def test_regions_run_from_open_to_close_or_to_the_end():
    text = "a<think>r</think>b<think>s"
    assert [(r.start, r.end, r.closed) for r in reasoning_regions(text)] == [(1, 17, True), (18, 26, False)]


def test_qwen3_completion_is_trained_as_written_and_off_mode_masks_the_empty_block():
    tok = tiny_tokenizer("qwen3")
    ids = tok("<think>\nab\n</think>\n\ncd<|im_end|>", add_special_tokens=False)["input_ids"]
    prompt = generation_prompt(tok, HI, {"enable_thinking": True})
    on, head = tokenize_generated(tok, prompt, ids, 512), len(prompt)
    assert tok.convert_ids_to_tokens(on.input_ids[head:]) == [  # the tiny vocabulary has no "\n\n"
        "<think>", "\n", "a", "b", "\n", "</think>", "[UNK]", "c", "d", "<|im_end|>"]
    assert int(on.reasoning.sum()) == 6 and int(on.assistant.sum()) == 10  # <think> \n a b \n </think>; 4 answer
    assert on.assistant[head:].all() and not on.assistant[:head].any()
    assert int(on.loss_mask.sum()) == 10
    answers = tokenize_generated(tok, prompt, ids, 512, train_reasoning=False)
    assert int(answers.loss_mask.sum()) == 4 and not answers.loss_mask[head - 1 : head + 5].any()
    assert not on.open_at_end
    cut = tokenize_generated(tok, prompt, ids[:4], 512)
    assert cut.open_at_end and int(cut.reasoning.sum()) == 4
    off = tokenize_generated(tok, generation_prompt(tok, HI, {"enable_thinking": False}),
                             tok("cd<|im_end|>", add_special_tokens=False)["input_ids"], 512)
    assert "<think>" in tok.decode(off.input_ids) and int(off.assistant.sum()) == 3 and int(off.reasoning.sum()) == 0


HARMONY_TURN = "<|channel|>analysis<|message|>ab<|end|><|start|>assistant<|channel|>final<|message|>cd<|return|>"


def test_harmony_analysis_is_the_reasoning_and_the_final_channel_the_answer():
    tok = tiny_tokenizer("harmony")
    prompt = generation_prompt(tok, HI, {"reasoning_effort": "low"})
    assert "".join(tok.convert_ids_to_tokens(prompt)) == (  # strftime_now: the pinned day, not today
        "<|start|>system<|message|>2026-01-01 Reasoning: low<|end|><|start|>user<|message|>hi<|end|><|start|>assistant")
    ids = tok(HARMONY_TURN, add_special_tokens=False)["input_ids"]
    on = tokenize_generated(tok, prompt, ids, 512)
    inside = [t for t, r in zip(tok.convert_ids_to_tokens(on.input_ids), on.reasoning) if r]
    assert "".join(inside) == "<|channel|>analysis<|message|>ab<|end|>" and int(on.assistant.sum()) == len(ids) == 33
    assert not on.open_at_end and int(on.loss_mask.sum()) == 33
    answers = tokenize_generated(tok, prompt, ids, 512, train_reasoning=False)
    assert int(answers.loss_mask.sum()) == 33 - 13  # <|start|>assistant<|channel|>final<|message|>cd<|return|>
    cut = tokenize_generated(tok, prompt, ids[:12], 512)  # stopped before <|end|>
    assert cut.open_at_end and int(cut.reasoning.sum()) == 12
    # the same turn taken back as gpt-oss's template takes it, then rendered: the same tokens, the same split
    ab, cd = (tok(t, add_special_tokens=False)["input_ids"] for t in ("ab", "cd"))
    assert harmony_message(tok, ids) == {"content": tok.decode(cd), "thinking": tok.decode(ab)}
    again = tokenize_conversation(tok, [*HI, {"role": "assistant", "content": "cd", "thinking": "ab"}], 512,
                                  {"reasoning_effort": "low"})
    assert again.input_ids.tolist() == on.input_ids.tolist() and again.reasoning.tolist() == on.reasoning.tolist()
    assert harmony_message(tok, ab + ids[-1:]) == {"content": tok.decode(ab)}  # no channel opened: all answer
    assert harmony_message(tok, ids[:11]) == {"content": "", "thinking": tok.decode(ab[:1])}  # cut in the analysis
    assert [(r.start, r.end) for r in reasoning_regions("x<think>y</think>", template_markers(GPT_OSS))] == []


@pytest.fixture(scope="module")
def thinking_target(tmp_path_factory) -> Path:
    """A tiny Qwen3-shaped target whose template has DeepSeek-V3.1's switch: thinking on opens <think> in the
    generation prompt, so everything the random target writes there is reasoning."""
    return build("qwen3", tmp_path_factory.mktemp("think") / "target", template="deepseek_v3.1",
                 num_hidden_layers=4)


@pytest.mark.parametrize("train_reasoning", [True, False])
def test_extract_mixes_modes_and_counts_reasoning_and_answer_tokens(tmp_path, thinking_target, train_reasoning):
    n = 8
    cwd = project(tmp_path, thinking_target, n, thinking="mix", max_thinking_tokens=12, max_new_tokens=6,
                  train_reasoning=train_reasoning)
    out = run_extract(cwd, thinking_target).communicate()[0]
    report = json.loads((cwd / "extract.json").read_text())
    think = report["thinking"]
    want_on = [thinking_on(f"c{i}", "mix", 0.5, 0) for i in range(n)]
    assert think["on"] == sum(want_on) and think["off"] == n - sum(want_on) and 0 < think["on"] < n, out
    fs = FeatureSet(cwd / "features")
    rows = {r["id"]: r for r in fs.manifest["samples"]}
    tok = AutoTokenizer.from_pretrained(thinking_target)
    think_id, close_id = tok.convert_tokens_to_ids(["<think>", "</think>"])
    for i, on in enumerate(want_on):
        r = rows[f"c{i}"]
        assert r["thinking"] is on
        sample = fs.read(next(ref for ref in fs.refs if ref.id == f"c{i}"))
        assert (think_id if on else close_id) in sample.input_ids.tolist()
        if on:  # everything after the opened <think> is reasoning, and no </think> came: cut
            assert r["answer_tokens"] == 0 and 0 < r["reasoning_tokens"] <= 12 and r["reasoning_cut"]
        else:
            assert r["reasoning_tokens"] == 0 and 0 < r["answer_tokens"] <= 6 and not r["reasoning_cut"]
        assert r["n_loss"] == r["answer_tokens"] + (r["reasoning_tokens"] if train_reasoning else 0)
    assert think["reasoning_cut"] == think["on"]
    assert think["reasoning_tokens"] == sum(r["reasoning_tokens"] for r in rows.values()) > 0
    assert report["loss_tokens"] == think["answer_tokens"] + (think["reasoning_tokens"] if train_reasoning else 0)


def _params(**over) -> dict:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for key, value in over.items():
        section, name = key.split(".")
        params[section][name] = value
    return params


@pytest.mark.parametrize(("over", "says"), [
    ({"extract.thinking": "mix", "extract.regenerate": False}, "hold no reasoning the target wrote"),
    ({"extract.thinking": "on", "prompts.max_turns": 2}, "set prompts.max_turns: 1"),
])
def test_params_that_cannot_make_reasoning_data_are_refused(tmp_path, over, says):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(_params(**over)))
    with pytest.raises(ParamsError, match=says):
        load_params(tmp_path / "params.yaml")


def test_a_template_without_a_switch_is_refused_at_the_target_stage(tmp_path, tiny_target):
    params = _params(**{"extract.thinking": "mix"})
    params["target"]["source"] = str(tiny_target)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    r = subprocess.run([sys.executable, str(REPO / "stages/target.py"), "out", "target.json", "unq"], cwd=tmp_path,
                       check=False, capture_output=True, text=True)
    assert r.returncode == 2 and "enable_thinking" in r.stderr and "jinja2.meta" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def harmony_target(tmp_path_factory) -> Path:
    """A tiny gpt-oss-shaped target with the harmony template (reasoning_effort, analysis and final channels)."""
    return build("gpt_oss", tmp_path_factory.mktemp("harmony") / "target", template="harmony")


@pytest.mark.parametrize(("harmony", "over", "says"), [
    (True, {"extract.thinking": "mix"}, "always reasons"),
    (True, {"prompts.max_turns": 2}, "ends the last assistant turn otherwise"),
    (False, {"extract.reasoning_effort": "low"}, "does not read reasoning_effort"),
])
def test_what_a_harmony_template_cannot_do_is_refused_at_the_target_stage(tmp_path, harmony_target, tiny_target,
                                                                          harmony, over, says):
    params = _params(**over)
    params["target"]["source"] = str(harmony_target if harmony else tiny_target)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    r = subprocess.run([sys.executable, str(REPO / "stages/target.py"), "out", "target.json", "unq"], cwd=tmp_path,
                       check=False, capture_output=True, text=True)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_extract_keeps_what_a_harmony_target_wrote_at_the_effort_asked(tmp_path, harmony_target):
    from transformers import AutoModelForCausalLM

    cwd = project(tmp_path, harmony_target, 3, thinking="on", reasoning_effort="low", max_thinking_tokens=10)
    out = run_extract(cwd, harmony_target).communicate()[0]
    think = json.loads((cwd / "extract.json").read_text())["thinking"]
    assert think["on"] == 3 and think["off"] == 0, out
    fs, tok = FeatureSet(cwd / "features"), AutoTokenizer.from_pretrained(harmony_target)
    model = AutoModelForCausalLM.from_pretrained(harmony_target, dtype=torch.float32).eval()
    for ref in fs.refs:
        sample, row = fs.read(ref), next(r for r in fs.manifest["samples"] if r["id"] == ref.id)
        ids = sample.input_ids.tolist()
        head = ids.index(tok.convert_tokens_to_ids("<|start|>"), 1)  # the system message ends before it
        assert "Reasoning: low" in "".join(tok.convert_ids_to_tokens(ids[:head]))
        prompt_len = len(ids) - row["reasoning_tokens"] - row["answer_tokens"]
        want = model.generate(torch.tensor([ids[:prompt_len]]), max_new_tokens=10, do_sample=False)[0].tolist()
        assert ids == want[: len(ids)] and len(ids) > prompt_len  # the completion as the target wrote it, greedy


def test_rounds_are_split_where_their_first_draft_lands():
    inside = [True] * 4 + [False] * 3
    got = split_rounds([(1, 2), (4, 0), (5, 3), (9, 1)], inside, 3)  # (9, 1): proposed past the end, an answer
    assert (got["reasoning"].rounds, got["reasoning"].emitted, got["reasoning"].accepted_per_pos) == (1, 3, [1, 1, 0])
    assert (got["answer"].rounds, got["answer"].emitted, got["answer"].accepted_per_pos) == (3, 7, [2, 1, 1])


def test_the_reasoning_of_an_output_is_told_from_its_prompt_and_markers():
    tok = tiny_tokenizer("qwen3")
    ids = tok("<think>\nab\n</think>\n\ncd<|im_end|>", add_special_tokens=False)["input_ids"]
    on = generation_prompt(tok, HI, {"enable_thinking": True})
    assert reasoning_inside(tok, on, ids) == [True] * 6 + [False] * 4
    opened = on + tok("<think>", add_special_tokens=False)["input_ids"]  # DeepSeek-V3.1's form: the prompt opens it
    assert reasoning_inside(tok, opened, ids[1:]) == [True] * 5 + [False] * 4
    off = generation_prompt(tok, HI, {"enable_thinking": False})  # its empty block is closed before the output
    assert reasoning_inside(tok, off, ids[-3:]) == [False] * 3


def test_reference_tau_is_given_per_thinking_mode_and_region(tmp_path, thinking_target):
    cfg = DraftConfig.from_target(json.loads((thinking_target / "config.json").read_text()), n_aux=3,
                                  draft_vocab_size=99)
    torch.manual_seed(0)
    save_draft(Eagle3Draft(cfg), tmp_path / "drafter")
    tok = AutoTokenizer.from_pretrained(thinking_target)
    records = [{"id": f"p{i}", "messages": [{"role": "user", "content": w}]} for i, w in enumerate(["hi", "ab"])]
    prompts = eval_prompts(tok, records, 2, "thinking", (True, False))
    assert [p["thinking"] for p in prompts] == [True, True, False, False]
    assert tok.convert_ids_to_tokens(prompts[0]["input_ids"][-1]) == "<think>"
    res = reference_eval(thinking_target, tmp_path / "drafter", [0, 1, 2], prompts, 3, 12)
    on, off = res["by_thinking"]["on"], res["by_thinking"]["off"]
    assert res["outputs_equal"] and on["rounds"] + off["rounds"] == res["rounds"] > 0
    for mode in (on, off):
        assert mode["reasoning"]["rounds"] + mode["answer"]["rounds"] == mode["rounds"]
        assert 1.0 <= mode["tau"] <= 4.0 and len(mode["acceptance_per_pos"]) == 3
    # the random target never closes the <think> its prompt opened: with thinking on every round is reasoning
    assert on["reasoning"]["rounds"] == on["rounds"] and off["reasoning"]["rounds"] == 0
    metrics = compact_serve_metrics({"k": 3, "gate": {"verdict": "ok"}, "reference": res})["reference"]["thinking"]
    assert metrics["on"] == {"tau": round(on["tau"], 4), "reasoning": round(on["tau"], 4), "answer": 0.0}


@pytest.mark.slow
@pytest.mark.vllm
def test_dvc_repro_mixes_thinking_50_50_and_serve_eval_gives_each_mode(tmp_path, thinking_target):
    """The whole pipeline on a tiny reasoning target with `extract.thinking: mix`, served by vLLM on the CPU."""
    from test_pipeline import dvc, tiny_repo

    pytest.importorskip("vllm")
    cwd = tiny_repo(tmp_path / "repo", thinking_target,
                    {"thinking": "mix", "max_new_tokens": 8, "max_thinking_tokens": 16, "max_length": 96})
    r = dvc(cwd, "repro")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    think = json.loads((cwd / "reports/extract.json").read_text())["thinking"]
    assert think["on"] + think["off"] == 8 and think["on"] > 0 and think["off"] > 0, think
    assert think["reasoning_tokens"] > 0 and think["answer_tokens"] > 0
    report = json.loads((cwd / "reports/serve_eval.json").read_text())
    assert report["prompts"] == report["prompts"][:2] * 2  # each eval prompt in both modes
    by = report["reference"]["by_thinking"]
    assert by["on"]["rounds"] + by["off"]["rounds"] == report["reference"]["rounds"]
    assert by["on"]["reasoning"]["rounds"] > 0 and by["off"]["reasoning"]["rounds"] == 0
    served = json.loads((cwd / "metrics/serve_eval.json").read_text())
    assert set(served["reference"]["thinking"]) == {"on", "off"} and served["vllm"]["tau"] >= 1.0
    assert report["vllm"]["outputs_equal"]
    vllm = report["vllm"]["by_thinking"]  # each mode served on its own: its own counters
    print(json.dumps({"reference": {m: v["tau"] for m, v in by.items()}, "vllm": vllm}))
    assert vllm["on"]["drafts"] + vllm["off"]["drafts"] == report["vllm"]["drafts"]
    for mode in ("on", "off"):
        assert vllm[mode]["outputs_equal"] and vllm[mode]["tau"] == pytest.approx(by[mode]["tau"], abs=0.02)
    assert set(served["vllm"]["thinking"]["on"]) == {"tau"}  # no reasoning / answer split from counters
