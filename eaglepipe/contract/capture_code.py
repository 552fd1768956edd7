"""What an engine class's EAGLE-3 capture code says, read from its source (nothing imported): its id form and a digest.

- **form** (SGLang): how the capture class's ``set_eagle3_layers_to_capture`` turns the draft config's ids into
  the layers whose input it captures (``sglang/srt/model_executor/model_runner_components/attention_backend_setup.py``
  calls it with ``eagle_aux_hidden_state_layer_ids``). The forms known, each the reading of one rule of
  :data:`eaglepipe.contract.rules.RULES` (its ``form``):

  - ``plus_one``: ``[val + 1 for val in layer_ids]`` whenever ids are given (llama.py; qwen2_moe.py passes the
    same list on to its model's own ``set_eagle3_layers_to_capture``);
  - ``plus_one_if_first_is_one``: that list only under ``if layer_ids and layer_ids[0] == 1`` (deepseek_v2.py);
  - ``identity_if_max_is_n``: that list unless ``max(layer_ids) == num_layers`` (gpt_oss.py).

  Anything else is no known form (None): the engine's own code must be read for a rule.
- **language model** (vLLM): the architecture a multimodal wrapper builds its decoder as
  (``init_vllm_registered_model(..., architectures=["Qwen2ForCausalLM"])`` in its ``__init__``); the wrapper's
  ``SupportsEagle3.set_aux_hidden_state_layers`` (``vllm/model_executor/models/interfaces.py``) hands the ids to
  that decoder, so its capture code decides what the wrapper captures.
- **digest**: sha256 of the capture code (the syntax tree, docstrings and positions left out, of every function in
  the class's files, and for vLLM in ``interfaces.py``, that names a capture token). Two releases with the same
  digest for a class run the same capture code, so a rule read in one holds in the other
  (:func:`eaglepipe.contract.convention.rule_for`).
"""

from __future__ import annotations

import ast
import hashlib

CAPTURE_TOKENS = ("aux_hidden_state", "_maybe_add_hidden_state", "layers_to_capture", "_is_layer_to_capture",
                  "captured_last_layer_outputs", "eagle3")
SGLANG_SETTER = "set_eagle3_layers_to_capture"
# The ``if`` tests above the ``val + 1`` list (:func:`_guard`, whether the list is in the if's body) → the form.
_FORM_OF_GUARDS = {
    (("none", False),): "plus_one",
    (("none", False), ("first_is_one", True)): "plus_one_if_first_is_one",
    (("none", False), ("max", False)): "identity_if_max_is_n",
}
FORMS = tuple(_FORM_OF_GUARDS.values())


def method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef | None:
    """The ``def name`` in class ``cls`` of a parsed module (top-level classes), or None."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == name), None)
    return None


def _is_plus_one(comp: ast.ListComp, param: str) -> bool:
    """``[v + 1 for v in <param>]``."""
    gen = comp.generators[0] if len(comp.generators) == 1 else None
    return (gen is not None and isinstance(gen.iter, ast.Name) and gen.iter.id == param and not gen.ifs
            and isinstance(gen.target, ast.Name) and isinstance(comp.elt, ast.BinOp)
            and isinstance(comp.elt.op, ast.Add) and isinstance(comp.elt.left, ast.Name)
            and comp.elt.left.id == gen.target.id and isinstance(comp.elt.right, ast.Constant)
            and comp.elt.right.value == 1)


def _guard(test: ast.expr, param: str) -> str | None:
    """What an ``if`` test on the ids checks: "none" (``param is None``), "first_is_one"
    (``param and param[0] == 1``), "max" (``max(param) == ...``, alone or under ``param and``), else "other";
    None when it does not read them."""
    text = ast.unparse(test)
    if param not in text:
        return None
    if text == f"{param} is None":
        return "none"
    if text in (f"{param} and {param}[0] == 1", f"{param}[0] == 1"):
        return "first_is_one"
    if f"max({param}) ==" in text:
        return "max"
    return "other"


def _conditions(fn: ast.FunctionDef, target: ast.AST, param: str) -> list[tuple[str | None, bool]]:
    """The ``if`` tests above ``target`` inside ``fn``: [(guard, target-is-in-the-body)], outermost first."""
    parent = {child: node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}
    out, node = [], target
    while node is not fn and node in parent:
        up = parent[node]
        if isinstance(up, ast.If) and node is not up.test:
            out.append((_guard(up.test, param), node in up.body))
        node = up
    return out[::-1]


def _param(fn: ast.FunctionDef) -> str:
    args = [a.arg for a in fn.args.args]
    return args[1] if len(args) > 1 else ""


def sglang_form(fn: ast.FunctionDef) -> tuple[str | None, int]:
    """The form of an SGLang ``set_eagle3_layers_to_capture`` (see the module docstring) and the line that shows
    it (the ``val + 1`` list; the def when there is none)."""
    param = _param(fn)
    comps = [n for n in ast.walk(fn) if isinstance(n, ast.ListComp) and _is_plus_one(n, param)]
    if len(comps) != 1:
        return None, fn.lineno
    guards = tuple((g, taken) for g, taken in _conditions(fn, comps[0], param) if g is not None)
    return _FORM_OF_GUARDS.get(guards), comps[0].lineno


def language_model(tree: ast.Module, cls: str) -> str | None:
    """The architecture class ``cls``'s ``__init__`` builds its language model as: the literal ``architectures=[X]``
    of an ``init_vllm_registered_model`` call there (vLLM's multimodal wrappers), or None."""
    init = method(tree, cls, "__init__")
    for node in ast.walk(init) if init is not None else ():
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "init_vllm_registered_model":
            arg = next((k.value for k in node.keywords if k.arg == "architectures"), None)
            if isinstance(arg, ast.List) and len(arg.elts) == 1 and isinstance(arg.elts[0], ast.Constant):
                return arg.elts[0].value
    return None


def _capture_functions(tree: ast.Module, source: str):
    """Every function of a module (at any depth) whose source names a capture token, in file order."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_source_segment(source, node) or ""
            if any(tok in text for tok in CAPTURE_TOKENS):
                yield node


def _normalized(fn: ast.AST) -> str:
    body = getattr(fn, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        fn = type(fn)(**{**{f: getattr(fn, f) for f in fn._fields}, "body": body[1:]})  # docstring left out
    return ast.dump(fn, annotate_fields=False, include_attributes=False)


def module_capture_code(tree: ast.Module, source: str) -> str:
    """A parsed module's capture code as text: its capture functions' syntax trees (docstrings and positions left
    out), in file order; what :func:`digest` hashes."""
    return "".join(_normalized(fn) for fn in sorted(_capture_functions(tree, source), key=lambda f: f.lineno))


def digest(capture_code: list[str]) -> str:
    """sha256 (first 16 hex digits) of modules' :func:`module_capture_code`, in the order given."""
    h = hashlib.sha256()
    for text in capture_code:
        h.update(text.encode())
    return h.hexdigest()[:16]
