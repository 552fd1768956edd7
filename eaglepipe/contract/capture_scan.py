"""Which model classes of each engine release can return EAGLE-3 aux hidden states, read from their source.

``python -m eaglepipe.contract.capture_scan`` writes ``eaglepipe/contract/capture_table.json``: engine → release →
section. The engines installed here are read in place (``--check``: exit 1 when their sections are not what their
code gives; tests/test_capture_support.py runs it, and checks the table against the engines' own predicates on
every class that imports). ``--wheel FILE`` also reads a release from its downloaded wheel without installing it
(``pip download --no-deps vllm==0.33.0``): its section says ``read_from: wheel ... (source read, not run)``.
Sections of releases not installed here stay as read. Nothing is imported from an engine: its files are parsed
(``ast``, :mod:`eaglepipe.contract.source_index`), so the table is the same on a CPU box and a GPU host, where
importing vLLM's or SGLang's model modules fails on different ones (a missing torchvision, CUDA kernels). Where a
module picks its classes by platform (vLLM's hardware-isolated entry points under vllm/models/), the CUDA branch
is read.

A section holds ``architectures`` (architecture → [its class, its capture class, its code class]) and
``capture_code`` (code class → the id form and digest of its capture code, :mod:`eaglepipe.contract.capture_code`).

What each engine's code says, and how it is read here:

- **vLLM**: the registry, ``vllm/model_executor/models/registry.py`` (the module-level ``_*_MODELS`` dicts merged
  into ``_VLLM_MODELS``: architecture → (module, class)). A class captures when ``SupportsEagle3``
  (``vllm/model_executor/models/interfaces.py``) is in its MRO — what ``supports_eagle3`` checks, and what
  ``v1/worker/gpu_model_runner.py _setup_eagle3_aux_hidden_state_outputs`` requires. Its capture class is the
  nearest class of the MRO that names ``SupportsEagle3`` among its own bases (e.g. ``Phi3ForCausalLM`` → llama.py
  ``LlamaForCausalLM``; every Transformers-backend class → ``transformers/base.py Base``, whose
  ``set_aux_hidden_state_layers`` records the output of layer ``layer - 1``).
- **SGLang**: the registry, ``sglang/srt/models/registry.py import_model_classes``, collects every module's
  ``EntryClass`` (a class or a list) under ``sglang/srt/models/``; read the same way here. A class captures when
  a class of its MRO defines ``set_eagle3_layers_to_capture``; the nearest one is its capture class (e.g.
  ``Phi3ForCausalLM(LlamaForCausalLM)`` → llama.py ``LlamaForCausalLM``).
- **hf** (transformers): ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (``transformers/models/auto/modeling_auto.py``),
  then ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` for the multimodal wrappers it lacks: model_type → the
  architecture a checkpoint of it declares; the engines look a target up by that name.

Which id meaning a capture class has is not decided here: :data:`eaglepipe.contract.rules.RULES` names the
capture classes each rule was read from and the SGLang id form each rule reads; a release no rule's versions
cover takes the rule of one whose capture code has the same digest (:func:`eaglepipe.contract.convention.rule_for`).
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.version import Version

from eaglepipe.contract import capture_code
from eaglepipe.contract.source_index import ClassRef, SourceIndex
from eaglepipe.engine_table import TABLE as ENGINES

TABLE_PATH = Path(__file__).with_name("capture_table.json")
VLLM_REGISTRY = "vllm.model_executor.models.registry"
VLLM_EAGLE3 = ("vllm.model_executor.models.interfaces", "SupportsEagle3")
SGLANG_MODELS = "sglang.srt.models"
HF_AUTO = "transformers.models.auto.modeling_auto"
HF_MAPS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES")  # causal LMs first

# --- the registries -------------------------------------------------------------------------------------------


def _vllm_registry(index: SourceIndex) -> dict[str, ClassRef]:
    """vLLM's ``_VLLM_MODELS`` (architecture → (module, class)), evaluated from registry.py's dict displays.

    Each module-level ``_..._MODELS = {...}`` is evaluated with no builtins in a namespace holding only the
    dicts before it (its ``**`` merges and comprehensions read those); values that are no (module, class) pair
    (a plugin's URL) are left out. Module names resolve as ``registry.py _get_model_module_name`` does: a name
    starting with ``vllm.`` is absolute, others are under ``vllm.model_executor.models``.
    """
    tree = index.module(VLLM_REGISTRY).tree
    namespace: dict[str, dict] = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.endswith("_MODELS") and isinstance(node.value, ast.Dict)):
            code = compile(ast.Expression(node.value), "registry.py", "eval")
            namespace[node.targets[0].id] = eval(code, {"__builtins__": {}}, dict(namespace))  # noqa: S307
    package = VLLM_REGISTRY.rpartition(".")[0]
    return {arch: (mod if mod.startswith("vllm.") else f"{package}.{mod}", cls)
            for arch, value in namespace["_VLLM_MODELS"].items()
            if isinstance(value, tuple) and len(value) == 2 for mod, cls in [value]}


def _sglang_registry(index: SourceIndex) -> dict[str, ClassRef]:
    """SGLang's registry: every module directly under sglang/srt/models with an ``EntryClass`` (a class or a
    list of them), as ``registry.py import_model_classes`` collects them; architecture = the class's name."""
    folder = index.root / Path(*SGLANG_MODELS.split("."))  # a namespace package: no __init__.py
    out: dict[str, ClassRef] = {}
    for path in sorted(folder.glob("*.py")):
        name = f"{SGLANG_MODELS}.{path.stem}"
        mod = index.module(name)
        kind, entry = mod.names.get("EntryClass", (None, None))
        entry = entry if kind == "expr" and path.stem != "__init__" else None
        for expr in (entry.elts if isinstance(entry, (ast.List, ast.Tuple)) else [entry] if entry else []):
            ref = index._resolve_expr(name, expr)
            if ref is not None:
                out[ref[1]] = ref
    return out


def _hf_architectures(index: SourceIndex) -> dict[str, str]:
    """model_type → the architecture a checkpoint of it declares: transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
    then ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` for the multimodal wrappers the first lacks (qwen2_5_vl →
    Qwen2_5_VLForConditionalGeneration), the name the engines' registries look a wrapper up by."""
    found: dict[str, dict[str, str]] = {}
    for node in index.module(HF_AUTO).tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in HF_MAPS:
            pairs = ast.literal_eval(node.value.args[0])  # OrderedDict([(model_type, class name), ...])
            found[node.targets[0].id] = {k: v for k, v in pairs if isinstance(v, str)}
    missing = [name for name in HF_MAPS if name not in found]
    if missing:
        raise RuntimeError(f"{HF_AUTO}: no {', '.join(missing)}")
    causal, wrappers = (found[name] for name in HF_MAPS)
    return {**causal, **{k: v for k, v in wrappers.items() if k not in causal}}


# --- capture classes -------------------------------------------------------------------------------------------


def _vllm_capture(index: SourceIndex, ref: ClassRef) -> ClassRef | None:
    """The nearest class of ``ref``'s MRO that names SupportsEagle3 among its own bases; None: no capture."""
    if VLLM_EAGLE3 not in index.mro(ref):
        return None
    return next(c for c in index.mro(ref) if VLLM_EAGLE3 in index.bases(c))


def _sglang_capture(index: SourceIndex, ref: ClassRef) -> ClassRef | None:
    """The nearest class of ``ref``'s MRO that defines set_eagle3_layers_to_capture; None: no capture."""
    return next((c for c in index.mro(ref) if index.defines(c, capture_code.SGLANG_SETTER)), None)


def _code_class(index: SourceIndex, ref: ClassRef, cap: ClassRef) -> ClassRef:
    """The class whose code decides what ``ref`` captures: the nearest class of its MRO, up to its capture class,
    that defines ``__init__`` (which builds the inner model whose forward captures) or ``forward``; the capture
    class when none before it does. A subclass that builds another inner model is its own code class, so a
    rule read from its parent never applies to it unread."""
    mro = index.mro(ref)
    chain = mro[: mro.index(cap) + 1] if cap in mro else [ref]
    return next((c for c in chain if index.defines(c, "__init__") or index.defines(c, "forward")), cap)


def _code_facts(index: SourceIndex, engine: str, cap: ClassRef, code: ClassRef, texts: dict[str, str]) -> dict:
    """What the capture code of a code class says (:mod:`eaglepipe.contract.capture_code`): SGLang's id form read
    from the capture class's setter, the line that shows it ("file:line"), the digest of the capture code of
    the capture and code classes' files (vLLM: and interfaces.py, where EagleModelMixin captures), and for a vLLM
    wrapper the architecture of the language model it builds (``language_model``, absent otherwise). ``texts``:
    module → its capture code, filled as modules are first read (each module's code is read once a scan)."""
    names = list(dict.fromkeys([cap[0], code[0]] + ([VLLM_EAGLE3[0]] if engine == "vllm" else [])))
    mods = [index.module(m) for m in names]
    for name, mod in zip(names, mods):
        if name not in texts and mod is not None:
            texts[name] = capture_code.module_capture_code(mod.tree, mod.source)
    form, line = None, next((n.lineno for n in mods[0].tree.body
                             if isinstance(n, ast.ClassDef) and n.name == cap[1]), 0)
    setter = capture_code.method(mods[0].tree, cap[1], capture_code.SGLANG_SETTER) if engine == "sglang" else None
    if setter is not None:
        form, line = capture_code.sglang_form(setter)
    facts = {"form": form, "at": f"{index.file(cap)}:{line}",
             "digest": capture_code.digest([texts[n] for n in names if n in texts])}
    inner = capture_code.language_model(index.module(code[0]).tree, code[1]) if engine == "vllm" else None
    return {**facts, "language_model": inner} if inner else facts


def _engine_rows(index: SourceIndex, engine: str, registry: dict[str, ClassRef], capture) -> tuple[dict, dict]:
    """architecture → [its class, its capture class, its code class], each "file:Class", the last two None
    when it cannot capture, sorted by architecture; and code class → :func:`_code_facts`."""
    rows, facts, texts = {}, {}, {}
    for arch in sorted(registry):
        ref = index.resolve(*registry[arch]) or registry[arch]  # where the class is defined (re-exports followed)
        mod = index.module(ref[0])
        cap = capture(index, ref) if mod is not None and ref[1] in mod.classes else None
        code = None if cap is None else _code_class(index, ref, cap)
        rows[arch] = [f"{index.file(c)}:{c[1]}" if c else None for c in (ref, cap, code)]
        if code is not None and rows[arch][2] not in facts:
            facts[rows[arch][2]] = _code_facts(index, engine, cap, code, texts)
    return rows, dict(sorted(facts.items()))


def _root(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def _version(engine: str) -> str | None:
    for dist in ENGINES[engine].packages:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# Per engine: its registry file; why a class cannot capture ({file} {cls}: the class and its file); the
# architecture it runs a target with when its registry does not name the target's (None: not one fixed class).
FACTS = {
    "vllm": {"registry": "vllm/model_executor/models/registry.py",
             "no_capture": "{file} {cls} does not implement SupportsEagle3 "
                           "(vllm/model_executor/models/interfaces.py), nor do its bases",
             "fallback": None},  # inspect_model_cls: the Transformers backend, dense or MoE by the config
    "sglang": {"registry": "sglang/srt/models/registry.py",
               "no_capture": "{file} defines no set_eagle3_layers_to_capture on {cls} or its bases",
               "fallback": "TransformersForCausalLM"},  # _ModelRegistry._normalize_archs appends it
    "hf": {"registry": "transformers/models/auto/modeling_auto.py"},
}


INSTALLED = "the installed package"
READERS = {"vllm": (_vllm_registry, _vllm_capture), "sglang": (_sglang_registry, _sglang_capture)}


def scan_engine(engine: str, root: Path, version: str, read_from: str) -> dict:
    """One engine release's section of the table, read from the package under ``root``: its version, where it was
    read from, :data:`FACTS`, ``capture_code`` (code class → :func:`_code_facts`) and ``architectures``."""
    registry, capture = READERS[engine]
    index = SourceIndex(root)
    rows, facts = _engine_rows(index, engine, registry(index), capture)
    return {"version": version, "read_from": read_from, **FACTS[engine], "capture_code": facts,
            "architectures": rows}


def scan() -> dict:
    """The table of every engine installed here (see the module docstring): engine → {version: section}
    (:func:`scan_engine`; hf: ``model_types`` in place of the capture fields)."""
    out: dict = {}
    for engine in READERS:
        root, version = _root(engine), _version(engine)
        if root is not None and version is not None:
            out[engine] = {version: scan_engine(engine, root, version, INSTALLED)}
    root, version = _root("transformers"), _version("hf")
    if root is not None and version is not None:
        out["hf"] = {version: {"version": version, "read_from": INSTALLED, **FACTS["hf"],
                               "model_types": _hf_architectures(SourceIndex(root))}}
    return out


def read_wheel(path: Path) -> dict:
    """{engine: {version: section}} of an engine's wheel (vllm, sglang), read without installing it: its Python
    files are unpacked to a temporary folder and scanned there. A release read this way is read, not run: the
    section's ``read_from`` says so. Raises ValueError for a file that is no wheel of a serving engine."""
    dist, _, rest = path.name.partition("-")
    version = rest.partition("-")[0]
    engine = {pkg.replace("-", "_"): name for name in READERS for pkg in ENGINES[name].packages}.get(dist)
    if engine is None or path.suffix != ".whl":
        raise ValueError(f"{path}: not a wheel of {sorted(READERS)} (a file named <dist>-<version>-...whl)")
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(path) as wheel:
        wheel.extractall(tmp, [m for m in wheel.namelist() if m.startswith(f"{engine}/") and m.endswith(".py")])
        return {engine: {version: scan_engine(engine, Path(tmp), version,
                                              f"wheel {path.name} (source read, not run)")}}


def _mapping_lines(key: str, items: dict, last: bool) -> list[str]:
    lines = [f'   "{key}": {{']
    lines += [f"    {json.dumps(k)}: {json.dumps(v)}" + ("," if j < len(items) - 1 else "")
              for j, (k, v) in enumerate(items.items())]
    return lines + ["   }" + ("" if last else ",")]


def render(table: dict) -> str:
    """JSON with one architecture (model_type, code class) per line, so an engine upgrade reads as a short diff."""
    lines = ["{", ' "produced_by": "python -m eaglepipe.contract.capture_scan",']
    engines = [e for e in table if e != "produced_by"]
    for i, engine in enumerate(engines):
        lines.append(f' "{engine}": {{')
        versions = list(table[engine].items())
        for j, (version, section) in enumerate(versions):
            small = {k: v for k, v in section.items() if not isinstance(v, dict)}
            long = [k for k, v in section.items() if isinstance(v, dict)]
            lines.append(f'  "{version}": {json.dumps(small)[:-1]},')
            for n, key in enumerate(long):
                lines += _mapping_lines(key, section[key], n == len(long) - 1)
            lines.append("  }" + ("," if j < len(versions) - 1 else ""))
        lines.append(" }" + ("," if i < len(engines) - 1 else ""))
    return "\n".join(lines + ["}"]) + "\n"


def stale(scanned: dict, stored: dict) -> list[str]:
    """"engine version" of each release installed here whose stored section is not what its code gives (releases
    not installed here are not judged: their sections stay as read where they were)."""
    return [f"{engine} {version}" for engine, sections in scanned.items() for version, body in sections.items()
            if stored.get(engine, {}).get(version) != json.loads(json.dumps(body))]


def merge(stored: dict, scanned: dict) -> dict:
    """The stored table with the scanned releases added or replaced (hf: only the scanned transformers kept)."""
    out = {e: dict(stored.get(e, {})) for e in FACTS if e in stored or e in scanned}
    for engine, sections in scanned.items():
        out[engine] = dict(sections) if engine == "hf" else {**out[engine], **sections}
    return {e: dict(sorted(out[e].items(), key=lambda kv: Version(kv[0]))) for e in out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the table is not what the installed engines give")
    ap.add_argument("--wheel", type=Path, action="append", default=[],
                    help="also read an engine release from its downloaded wheel (pip download --no-deps vllm==X), "
                         "without installing it")
    ap.add_argument("--out", type=Path, default=TABLE_PATH)
    a = ap.parse_args(argv)
    scanned = scan()
    if a.check:
        bad = stale(scanned, json.loads(a.out.read_text()))
        if bad:
            print(f"{a.out}: the sections {bad} are stale for the engines installed here: run "
                  "python -m eaglepipe.contract.capture_scan", file=sys.stderr)
        return 1 if bad else 0
    table = json.loads(a.out.read_text()) if a.out.exists() else {}
    for wheel in a.wheel:
        try:
            table = merge(table, read_wheel(wheel))
        except (ValueError, zipfile.BadZipFile) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    a.out.write_text(render(merge(table, scanned)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
