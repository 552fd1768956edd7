"""dvc.yaml is complete by construction: every project module a stage's script can import is one of its deps.

The import closure is derived statically by eaglepipe.sources.import_closure (ast, nothing executed): every
`import eaglepipe...` / `from eaglepipe... import ...` / relative import anywhere in a file (function bodies
included, since engines are imported lazily), the engine dispatch (every engine of eaglepipe.engine_table), and
modules an engine loads by name, followed transitively through the package. The deps are exactly that closure:
a module a stage never runs is not a dep, so editing serving code does not rerun training.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from eaglepipe.sources import code_hash, import_closure

REPO = Path(__file__).resolve().parents[1]
def _covered(f: Path, deps: list[str]) -> bool:
    rel = f.relative_to(REPO)
    return any(rel == Path(d) or Path(d) in rel.parents for d in deps)


def test_every_stage_depends_on_exactly_its_import_closure():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    missing, extra = [], []
    for name, st in stages.items():
        script = REPO / st["cmd"].split()[1]
        deps = [str(d) for d in st.get("deps", [])]
        assert _covered(script, deps), f"stage {name}: its script {script.name} is not a dep"
        closure = import_closure(script)
        missing += [f"{name}: {f.relative_to(REPO)}" for f in closure if not _covered(f, deps)]
        code = {REPO / d for d in deps if d.startswith("eaglepipe/")}
        extra += [f"{name}: {f.relative_to(REPO)}" for f in sorted(code - set(closure))]
    assert not missing, "dvc.yaml deps miss modules the stage imports:\n" + "\n".join(missing)
    assert not extra, "dvc.yaml deps name modules the stage never runs (a change there would rerun it):\n" + \
        "\n".join(extra)


def test_closure_follows_lazy_imports_and_the_engine_dispatch():
    serve = {f.relative_to(REPO).as_posix() for f in import_closure(REPO / "stages" / "serve_eval.py")}
    # evaluate imports draft/specdec/template; get_engine dispatches to every engine of engine_table's TABLE, and
    # vLLM loads the connector by its dotted name (a string constant)
    assert {"eaglepipe/serving/evaluate.py", "eaglepipe/model/draft.py", "eaglepipe/serving/specdec.py",
            "eaglepipe/data/template.py", "eaglepipe/engines/__init__.py", "eaglepipe/engines/vllm.py",
            "eaglepipe/engines/sglang.py", "eaglepipe/engines/vllm_connector.py"} <= serve
    train = {f.relative_to(REPO).as_posix() for f in import_closure(REPO / "stages" / "train_drafter.py")}
    # online training captures through the store's engine (any of engine_table), but never measures serving
    assert {"eaglepipe/engines/hf.py", "eaglepipe/engines/vllm.py", "eaglepipe/engines/sglang.py"} <= train
    assert not train & {"eaglepipe/serving/evaluate.py", "eaglepipe/serving/specdec.py", "eaglepipe/data/prompts.py"}


def test_command_paths_are_deps_or_outs():
    """Every data/ path a stage's cmd reads is one of its deps (it writes the others as outs/metrics)."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    bad = []
    for name, st in stages.items():
        deps = [str(d) for d in st.get("deps", [])]
        outs = [next(iter(o)) if isinstance(o, dict) else o for k in ("outs", "metrics", "plots") for o in st.get(k, [])]
        for arg in st["cmd"].split()[2:]:
            if not (_covered(REPO / arg, deps) or any(arg == o or arg.startswith(o + "/") for o in outs)):
                bad.append(f"{name}: {arg}")
    assert not bad, "cmd paths that are neither deps nor outs:\n" + "\n".join(bad)


def test_extract_resume_key_follows_the_code(tmp_path):
    """The extract resume key changes when a module extract imports changes, and only then."""
    import shutil

    for d in ("eaglepipe", "stages"):
        shutil.copytree(REPO / d, tmp_path / d)
    script = tmp_path / "stages" / "extract.py"
    closure = {f.relative_to(tmp_path).as_posix() for f in import_closure(script, tmp_path)}
    assert "eaglepipe/data/template.py" in closure and "eaglepipe/train/loop.py" not in closure
    before = code_hash(script)
    (tmp_path / "eaglepipe" / "train" / "loop.py").write_text("# not imported by extract\n")
    assert code_hash(script) == before
    template = tmp_path / "eaglepipe" / "data" / "template.py"
    template.write_text(template.read_text() + "\n#\n")
    assert code_hash(script) != before
