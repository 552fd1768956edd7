"""Which model classes of the installed engines can return EAGLE-3 aux hidden states, read from their source.

``python -m eaglepipe.contract.capture_scan`` writes ``eaglepipe/contract/capture_table.json`` (``--check``: exit 1
when the file is not what the installed engines give; tests/test_capture_support.py runs it, and checks the table
against the engines' own predicates on every class that imports). Nothing is imported from an engine: its files
are parsed (``ast``), so the table is the same on a CPU box and a GPU host, where importing vLLM's or SGLang's
model modules fails on different ones (a missing torchvision, CUDA kernels). Where a module picks its classes by
platform (vLLM's hardware-isolated entry points under vllm/models/), the CUDA branch is read (:func:`_branch`).

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
  model_type → the architecture a checkpoint of it declares; the engines look a target up by that name.

Which id meaning a capture class has is not decided here: :data:`eaglepipe.contract.convention.RULES` names the
capture classes each rule was read from.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eaglepipe.engine_table import TABLE as ENGINES

TABLE_PATH = Path(__file__).with_name("capture_table.json")
VLLM_REGISTRY = "vllm.model_executor.models.registry"
VLLM_EAGLE3 = ("vllm.model_executor.models.interfaces", "SupportsEagle3")
SGLANG_MODELS = "sglang.srt.models"
SGLANG_CAPTURE = "set_eagle3_layers_to_capture"
HF_AUTO = "transformers.models.auto.modeling_auto"

ClassRef = tuple[str, str]  # (dotted module where the class is defined, class name)


@dataclass
class _Module:
    """One parsed source file: each module-level name bound as Python binds it at import here (see
    :func:`_statements`), and the classes it defines (name → base expressions, names defined in the body)."""

    name: str
    path: Path
    names: dict[str, tuple[str, object]] = field(default_factory=dict)  # name → ("class"|"from"|"module"|"expr", ..)
    classes: dict[str, tuple[list[ast.expr], set[str]]] = field(default_factory=dict)


class SourceIndex:
    """Classes of installed packages, read from their files (nothing imported); MROs resolved through imports.

    ``root``: the folder that holds the packages (site-packages). Names that lead outside ``root`` or to no
    class (``nn.Module``, ``Protocol``) stay unresolved: they end an MRO. A class made by a call on a class
    (vLLM's ``as_embedding_model(LlamaForCausalLM)``) counts as that class.
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self._modules: dict[str, _Module | None] = {}

    def module(self, name: str) -> _Module | None:
        if name not in self._modules:
            base = self.root / Path(*name.split("."))
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
            self._modules[name] = None if path is None else _parse(name, path)
        return self._modules[name]

    def resolve(self, module: str, name: str, depth: int = 0) -> ClassRef | None:
        """Where the class that ``name`` means inside ``module`` is defined (following imports and aliases)."""
        mod = self.module(module)
        kind, what = mod.names.get(name, (None, None)) if mod and depth < 20 else (None, None)
        if kind == "class":
            return module, name
        if kind == "from":
            src, attr = what
            return self.resolve(src, attr, depth + 1)
        if kind == "expr":
            return self._resolve_expr(module, what, depth + 1)
        return None

    def _resolve_expr(self, module: str, expr: ast.expr, depth: int = 0) -> ClassRef | None:
        if isinstance(expr, ast.Name):
            return self.resolve(module, expr.id, depth)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):  # alias.Class
            mod = self.module(module)
            kind, what = mod.names.get(expr.value.id, (None, None)) if mod else (None, None)
            if kind == "module":
                return self.resolve(what, expr.attr, depth)
            if kind == "from":  # `from pkg import submodule`
                return self.resolve(f"{what[0]}.{what[1]}", expr.attr, depth)
        if isinstance(expr, ast.Subscript):  # Generic[T], SomeBase[Config]
            return self._resolve_expr(module, expr.value, depth)
        if isinstance(expr, ast.Call) and expr.args:  # an adapter building a class from a class
            return self._resolve_expr(module, expr.args[0], depth)
        return None

    def bases(self, ref: ClassRef) -> list[ClassRef]:
        """The resolved direct bases of ``ref``, in order (unresolved ones left out)."""
        mod = self.module(ref[0])
        exprs = mod.classes[ref[1]][0] if mod and ref[1] in mod.classes else []
        return [b for b in (self._resolve_expr(ref[0], e) for e in exprs) if b is not None]

    def defines(self, ref: ClassRef, name: str) -> bool:
        mod = self.module(ref[0])
        return bool(mod and ref[1] in mod.classes and name in mod.classes[ref[1]][1])

    def mro(self, ref: ClassRef) -> list[ClassRef]:
        """C3 linearization over the resolved bases (Python's MRO, restricted to classes found in the sources)."""
        return _c3(ref, self.bases, set())

    def file(self, ref: ClassRef) -> str:
        """The class's file, relative to ``root`` (e.g. ``vllm/model_executor/models/phi3.py``)."""
        mod = self.module(ref[0])
        return mod.path.relative_to(self.root).as_posix() if mod else ref[0].replace(".", "/") + ".py"


def _branch(test: ast.expr) -> bool | None:
    """Which way an ``if`` goes when read for a CUDA machine: False for ``TYPE_CHECKING``; for a test of
    ``current_platform`` (vLLM's hardware-isolated entry points under vllm/models/), True only when it asks for
    CUDA (``is_cuda()``, ``is_cuda_alike()``); None (every branch) otherwise."""
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)}
    if "TYPE_CHECKING" in names:
        return False
    if "current_platform" in names:
        return bool(names & {"is_cuda", "is_cuda_alike"})
    return None


def _statements(body: list[ast.stmt]):
    """Module-level statements in the order they bind names at import, read for a CUDA machine (:func:`_branch`);
    other ``if`` and ``try`` give every branch, the first binding of a name winning."""
    for node in body:
        if isinstance(node, ast.If):
            way = _branch(node.test)
            yield from _statements(node.body if way else node.orelse if way is False else node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _statements(node.body + [s for h in node.handlers for s in h.body] + node.orelse)
        else:
            yield node


def _parse(name: str, path: Path) -> _Module:
    mod = _Module(name, path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.ImportFrom):
            src = node.module or ""
            if node.level:
                parts = package.split(".")
                src = ".".join(parts[: len(parts) - node.level + 1] + ([src] if src else []))
            for a in node.names:
                mod.names.setdefault(a.asname or a.name, ("from", (src, a.name)))
        elif isinstance(node, ast.Import):
            for a in node.names:  # `import a.b as x` binds x to a.b; `import a.b` binds a to a
                top = a.name.split(".")[0]
                mod.names.setdefault(a.asname or top, ("module", a.name if a.asname else top))
        elif isinstance(node, ast.ClassDef) and node.name not in mod.names:
            names = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            names |= {t.id for n in node.body if isinstance(n, ast.Assign)
                      for t in n.targets if isinstance(t, ast.Name)}
            mod.classes[node.name] = (list(node.bases), names)
            mod.names[node.name] = ("class", None)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            mod.names.setdefault(node.targets[0].id, ("expr", node.value))
    return mod


def _c3(ref: ClassRef, bases_of, active: set[ClassRef]) -> list[ClassRef]:
    if ref in active:  # a cycle through unresolved re-exports: stop
        return [ref]
    active = active | {ref}
    seqs = [_c3(b, bases_of, active) for b in bases_of(ref)] + [bases_of(ref)]
    out = [ref]
    seqs = [list(s) for s in seqs if s]
    while seqs:
        head = next((s[0] for s in seqs if not any(s[0] in t[1:] for t in seqs)), seqs[0][0])  # inconsistent: first
        out.append(head)
        seqs = [[c for c in s if c != head] for s in seqs]
        seqs = [s for s in seqs if s]
    return out


# --- the registries -------------------------------------------------------------------------------------------


def _vllm_registry(index: SourceIndex) -> dict[str, ClassRef]:
    """vLLM's ``_VLLM_MODELS`` (architecture → (module, class)), evaluated from registry.py's dict displays.

    Each module-level ``_..._MODELS = {...}`` is evaluated with no builtins in a namespace holding only the
    dicts before it (its ``**`` merges and comprehensions read those); values that are no (module, class) pair
    (a plugin's URL) are left out. Module names resolve as ``registry.py _get_model_module_name`` does: a name
    starting with ``vllm.`` is absolute, others are under ``vllm.model_executor.models``.
    """
    tree = ast.parse(index.module(VLLM_REGISTRY).path.read_text())
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
    """transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: model_type → the causal-LM architecture."""
    tree = ast.parse(index.module(HF_AUTO).path.read_text())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"):
            pairs = ast.literal_eval(node.value.args[0])  # OrderedDict([(model_type, class name), ...])
            return {k: v for k, v in pairs if isinstance(v, str)}
    raise RuntimeError(f"{HF_AUTO}: no MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")


# --- capture classes -------------------------------------------------------------------------------------------


def _vllm_capture(index: SourceIndex, ref: ClassRef) -> ClassRef | None:
    """The nearest class of ``ref``'s MRO that names SupportsEagle3 among its own bases; None: no capture."""
    if VLLM_EAGLE3 not in index.mro(ref):
        return None
    return next(c for c in index.mro(ref) if VLLM_EAGLE3 in index.bases(c))


def _sglang_capture(index: SourceIndex, ref: ClassRef) -> ClassRef | None:
    """The nearest class of ``ref``'s MRO that defines set_eagle3_layers_to_capture; None: no capture."""
    return next((c for c in index.mro(ref) if index.defines(c, SGLANG_CAPTURE)), None)


def _code_class(index: SourceIndex, ref: ClassRef, cap: ClassRef) -> ClassRef:
    """The class whose code decides what ``ref`` captures: the nearest class of its MRO, up to its capture class,
    that defines ``__init__`` (which builds the inner model whose forward captures) or ``forward``; the capture
    class when none before it does. A subclass that builds another inner model is its own code class, so a
    rule read from its parent never applies to it unread."""
    mro = index.mro(ref)
    chain = mro[: mro.index(cap) + 1] if cap in mro else [ref]
    return next((c for c in chain if index.defines(c, "__init__") or index.defines(c, "forward")), cap)


def _engine_rows(index: SourceIndex, registry: dict[str, ClassRef], capture) -> dict[str, list]:
    """architecture → [its class, its capture class, its code class], each "file:Class", the last two None
    when it cannot capture; sorted by architecture."""
    rows = {}
    for arch in sorted(registry):
        ref = index.resolve(*registry[arch]) or registry[arch]  # where the class is defined (re-exports followed)
        mod = index.module(ref[0])
        cap = capture(index, ref) if mod is not None and ref[1] in mod.classes else None
        code = None if cap is None else _code_class(index, ref, cap)
        rows[arch] = [f"{index.file(c)}:{c[1]}" if c else None for c in (ref, cap, code)]
    return rows


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


def scan() -> dict:
    """The table of every engine installed here (see the module docstring): per engine its version,
    :data:`FACTS` and ``architectures`` (hf: ``model_types``)."""
    readers = {"vllm": (_vllm_registry, _vllm_capture), "sglang": (_sglang_registry, _sglang_capture)}
    out: dict = {}
    for engine, (registry, capture) in readers.items():
        root, version = _root(engine), _version(engine)
        if root is None or version is None:
            continue
        index = SourceIndex(root)
        out[engine] = {"version": version, **FACTS[engine],
                       "architectures": _engine_rows(index, registry(index), capture)}
    root = _root("transformers")
    if root is not None:
        out["hf"] = {"version": _version("hf"), **FACTS["hf"], "model_types": _hf_architectures(SourceIndex(root))}
    return out


def render(table: dict) -> str:
    """JSON with one architecture (or model_type) per line, so an engine upgrade reads as a short diff."""
    lines = ["{", ' "produced_by": "python -m eaglepipe.contract.capture_scan",']
    for i, engine in enumerate(table):
        body = dict(table[engine])
        key = "architectures" if "architectures" in body else "model_types"
        items = list(body.pop(key).items())
        head = json.dumps(body)[:-1]  # the small fields, then the long mapping one entry per line
        lines.append(f' "{engine}": {head}, "{key}": {{')
        lines += [f"  {json.dumps(k)}: {json.dumps(v)}" + ("," if j < len(items) - 1 else "")
                  for j, (k, v) in enumerate(items)]
        lines.append(" }}" + ("," if i < len(table) - 1 else ""))
    return "\n".join(lines + ["}"]) + "\n"


def stale(scanned: dict, stored: dict) -> list[str]:
    """Engines installed here whose section of the stored table is not what their code gives (engines not
    installed here are not judged: their section stays as read where they were)."""
    return [engine for engine, body in scanned.items() if stored.get(engine) != json.loads(json.dumps(body))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the table is not what the installed engines give")
    ap.add_argument("--out", type=Path, default=TABLE_PATH)
    a = ap.parse_args(argv)
    scanned = scan()
    if a.check:
        bad = stale(scanned, json.loads(a.out.read_text()))
        if bad:
            print(f"{a.out}: the sections {bad} are stale for the engines installed here: run "
                  "python -m eaglepipe.contract.capture_scan", file=sys.stderr)
        return 1 if bad else 0
    stored = json.loads(a.out.read_text()) if a.out.exists() else {}
    merged = {**{e: b for e, b in stored.items() if e in FACTS}, **scanned}  # engines not installed here: kept
    a.out.write_text(render({e: merged[e] for e in FACTS if e in merged}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
