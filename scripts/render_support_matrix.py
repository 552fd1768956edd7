"""Rewrite benchmarks/README.md's support-matrix section from metrics/support_matrix.json (generated, never typed).

Usage: python scripts/render_support_matrix.py [--check]
The section lies between the markers ``<!-- support-matrix:start -->`` and ``<!-- support-matrix:end -->``;
``--check`` exits 1 when benchmarks/README.md is not what the JSON renders to (for CI).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"
ENGINE_NAMES = {"hf": "hf (transformers)", "vllm": "vLLM", "sglang": "SGLang capture"}


def _cell(row: dict, notes: list[str]) -> str:
    if row["status"] == "verified":
        return f"verified (cos {row['min_cosine']:.6f}, ids {row['ids']})"
    notes.append(f"{row['target']} / {row['engine']}: {row['reason']}")
    return f"{row['status']} [{len(notes)}]"


def render(doc: dict) -> str:
    """The markdown table (one line per target, one column per engine) and its numbered notes."""
    versions = doc.get("versions", {})
    engines = list(dict.fromkeys(r["engine"] for r in doc["rows"]))
    targets = list(dict.fromkeys(r["target"] for r in doc["rows"]))
    head = [f"{ENGINE_NAMES.get(e, e)} {versions.get(e) or ''}".strip() for e in engines]
    lines = [f"Measured by `{doc['produced_by']}` ({doc['seconds']:.0f} s over its runs on a 2-core CPU "
             "machine; `--merge` adds families): tiny random "
             f"targets (N = 6), layers h{doc['layers']}, target → extract (hf; vLLM for a pre-quantized "
             "checkpoint) → train → export → inspect, then "
             f"each engine's own capture with the exported ids against the stored features "
             f"(verified = offset 0, cosine ≥ {doc['min_cosine']}).", "",
             "| target | family | RoPE | " + " | ".join(head) + " |",
             "|---|---|---|" + "---|" * len(engines)]
    notes: list[str] = []
    for t in targets:
        rows = {r["engine"]: r for r in doc["rows"] if r["target"] == t}
        first = next(iter(rows.values()))
        cells = [_cell(rows[e], notes) if e in rows else "—" for e in engines]
        lines.append(f"| {t} | {first['family']} | {first['rope_type']} | " + " | ".join(cells) + " |")
    lines += [""] + [f"{i}. {n}" for i, n in enumerate(notes, 1)]
    return "\n".join(lines)


def main() -> None:
    doc = json.loads((REPO / "metrics" / "support_matrix.json").read_text())
    readme = REPO / "benchmarks" / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        sys.exit(f"benchmarks/README.md has no {START} ... {END} section")
    a, b = text.index(START) + len(START), text.index(END)
    new = text[:a] + "\n" + render(doc) + "\n" + text[b:]
    if "--check" in sys.argv:
        sys.exit(0 if new == text else
                 "benchmarks/README.md's support matrix is stale: run python scripts/render_support_matrix.py")
    readme.write_text(new)


if __name__ == "__main__":
    main()
