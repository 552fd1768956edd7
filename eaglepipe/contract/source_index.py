"""Classes of an installed (or unpacked) package read from its files, nothing imported: what each module binds,
each class's bases and the names its body defines, MROs resolved through imports (:class:`SourceIndex`).
:mod:`eaglepipe.contract.capture_scan` reads the engines' model registries and capture classes with it."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ClassRef = tuple[str, str]  # (dotted module where the class is defined, class name)


@dataclass
class _Module:
    """One parsed source file: each module-level name bound as Python binds it at import here (see
    :func:`_statements`), and the classes it defines (name → base expressions, names defined in the body)."""

    name: str
    path: Path
    source: str = ""
    tree: ast.Module | None = None
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
    source = path.read_text()
    mod = _Module(name, path, source, ast.parse(source))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _statements(mod.tree.body):
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
