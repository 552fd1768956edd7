"""The engines decide which targets they capture: the capture table is their code, the rules name its classes.

Fast tier: the table equals what eaglepipe/contract/capture_scan.py reads from the installed engines' files; the
scanner's class resolution on a synthetic package; every hand-listed family's engine class is one its rule was
read from; families no rule lists (phi3, granite, olmo2) resolve through the class each engine captures with.
Engine tiers: the table against the engines' own predicates at import (vLLM ``supports_eagle3``, SGLang's MRO),
and real captures of tiny phi3 / granite / olmo2 targets through vLLM against eaglepipe's hf capture.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from eaglepipe.contract import capture_code, capture_scan, capture_support
from eaglepipe.contract import convention as conv
from eaglepipe.contract.rules import ANY, RULES, version_matches
from eaglepipe.contract.source_index import SourceIndex
from eaglepipe.errors import ConventionError

REPO = Path(__file__).resolve().parents[1]
TABLE = capture_support.table()
# the installed releases (else the newest read): the sections the installed-engine tests compare against
SGL, VLLM = (conv.installed_version(e) or capture_support.read_versions(e)[-1] for e in ("sglang", "vllm"))
SECTIONS = {"sglang": capture_support.section("sglang", SGL), "vllm": capture_support.section("vllm", VLLM)}
LLAMA = {"vllm": "vllm/model_executor/models/llama.py:LlamaForCausalLM",
         "sglang": "sglang/srt/models/llama.py:LlamaForCausalLM"}


def test_the_table_is_what_the_installed_engines_code_gives():
    """Regenerated from the installed engines' files, the table is unchanged (an engine upgrade fails here until
    ``python -m eaglepipe.contract.capture_scan`` is rerun and the rules re-read)."""
    scanned = capture_scan.scan()
    installed = {e for e in ("vllm", "sglang") if conv.installed_version(e)}
    assert set(scanned) == installed | {"hf"}
    assert capture_scan.stale(scanned, TABLE) == []


def test_scanner_follows_imports_aliases_and_inheritance(tmp_path):
    """A synthetic engine package: capture found through a re-export and an alias; a subclass that builds its own
    model (defines __init__) is its own code class; one that only renames is not."""
    pkg = tmp_path / "eng" / "models"
    pkg.mkdir(parents=True)
    (tmp_path / "eng" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .base import Llama as Llama\n")
    (pkg / "base.py").write_text(
        "import torch.nn as nn\nclass Llama(nn.Module):\n    def __init__(self): pass\n"
        "    def set_eagle3_layers_to_capture(self, ids): pass\n")
    (pkg / "phi.py").write_text(
        "from eng.models import Llama\nBase = Llama\nclass Phi(Base):\n    packed = {}\n"
        "class Own(Llama):\n    def __init__(self): pass\nclass Plain:\n    pass\nEntryClass = [Phi, Own, Plain]\n")
    index = SourceIndex(tmp_path)
    phi, own, plain = (("eng.models.phi", n) for n in ("Phi", "Own", "Plain"))
    llama = ("eng.models.base", "Llama")
    assert index.mro(phi) == [phi, llama]
    assert capture_scan._sglang_capture(index, phi) == capture_scan._sglang_capture(index, own) == llama
    assert capture_scan._sglang_capture(index, plain) is None
    assert capture_scan._code_class(index, phi, llama) == llama
    assert capture_scan._code_class(index, own, llama) == own
    assert index.file(phi) == "eng/models/phi.py"


def _model_types(family: str) -> list[str]:
    return [t for t, f in conv._FAMILY_OF_MODEL_TYPE.items() if f == family]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_listed_family_captures_through_a_class_its_rule_was_read_from(engine):
    """For the installed version (else the newest read): each family a rule lists maps (transformers' architecture
    → the engine's registry) to a class whose capture code that rule names; a refusal rule's class captures nothing
    or is named by it; and every class a rule names is still one the engine captures with. A rule applies where
    its versions match or, for a release read from a wheel, where it is carried over (same capture-code digests)."""
    body = SECTIONS[engine]
    version = Version(body["version"])
    code_classes = {row[2] for row in body["architectures"].values() if row[2]}
    checked = 0
    applies = [r for r in RULES if r.engine == engine
               and (version_matches(r, version) or conv.carried_over([r], engine, str(version)) is not None)]
    for rule in applies:
        assert not set(rule.classes) - code_classes, f"{rule.source}: no {engine} class captures through these"
        for family in (f for f in rule.families if f != ANY):
            for model_type in _model_types(family):
                arch = capture_support.architecture_of(model_type)
                row = body["architectures"].get(arch)
                if row is None:
                    continue  # transformers has no class for it (kimi_k25) or the engine none: nothing to compare
                ok = row[2] in rule.classes or (rule.read is None and row[1] is None)
                assert ok, f"{engine} {version}: {model_type} ({arch}) captures through {row[2]}, not named by " \
                           f"the rule for {family} ({rule.classes})"
                checked += 1
    assert checked >= 8


def test_families_no_rule_lists_take_the_rule_of_their_capture_class():
    """phi3 inherits Llama's capture in both engines; granite is vLLM's own; olmo2 is vLLM's Transformers backend;
    SGLang's granite.py / olmo2.py have no capture, refused for SGLang only, naming the file."""
    for engine, version in (("vllm", VLLM), ("sglang", SGL)):
        cap = capture_support.lookup(engine, version, "phi3")
        assert cap.code_class == LLAMA[engine] and cap.refusal is None
        assert conv.rule_for(engine, "phi3", version) == conv.rule_for(engine, "llama", version)  # carried: a copy
    assert capture_support.lookup("sglang", SGL, "phi3").engine_class == "sglang/srt/models/llama.py:Phi3ForCausalLM"
    granite = ("vllm/model_executor/models/granite.py:GraniteForCausalLM",)
    assert conv.rule_for("vllm", "granite", VLLM).classes == granite
    olmo2 = capture_support.lookup("vllm", VLLM, "olmo2")
    assert olmo2.capture_class == "vllm/model_executor/models/transformers/base.py:Base"
    assert conv.capturable("vllm", "olmo2", 16, VLLM) == range(1, 17)  # id 0 is no h[0] there
    for family, file in (("granite", "granite.py"), ("olmo2", "olmo2.py")):
        with pytest.raises(ConventionError, match=rf"sglang {SGL} has no EAGLE-3 capture for .* \(sglang/srt/models/"
                                                  rf"{file} defines no set_eagle3_layers_to_capture"):
            conv.rule_for("sglang", family, SGL)
    assert conv.rule_for("hf", "granite").engine == "hf"  # hf never asks an engine


def test_an_unknown_architecture_runs_in_sglangs_fallback_and_vllm_refuses_to_guess():
    cap = capture_support.lookup("sglang", SGL, "falcon")  # not in SGLang's registry: TransformersForCausalLM
    assert "sglang/srt/models/transformers.py defines no set_eagle3_layers_to_capture" in cap.refusal
    assert "HeliumForCausalLM" not in SECTIONS["vllm"]["architectures"]
    with pytest.raises(ConventionError, match=r"no model class of its own for HeliumForCausalLM .* Transformers "
                                              r"backend, dense or MoE .* refusing to guess"):
        capture_support.lookup("vllm", VLLM, "helium")


# --- id forms, releases read from wheels ---------------------------------------------------------------------

_SETTERS = {  # SGLang set_eagle3_layers_to_capture bodies, as the engines write them → the form read
    "plus_one": "if layer_ids is None:\n    self.model.layers_to_capture = [2, 3]\nelse:\n"
                "    self.model.layers_to_capture = [val + 1 for val in layer_ids]",
    "plus_one ": "if layer_ids is None:\n    self.model.set_eagle3_layers_to_capture([2, 3])\nelse:\n"
                 "    self.model.set_eagle3_layers_to_capture([val + 1 for val in layer_ids])",  # qwen2_moe.py
    "plus_one_if_first_is_one": "if layer_ids is None:\n    x = [2]\nelse:\n    if layer_ids and layer_ids[0] == 1:\n"
                                "        x = [val + 1 for val in layer_ids]\n    else:\n        x = layer_ids",
    "identity_if_max_is_n": "if layer_ids is None:\n    x = [2]\nelse:\n    if layer_ids and max(layer_ids) == n:\n"
                            "        x = list(layer_ids)\n    else:\n        x = [val + 1 for val in layer_ids]",
    None: "if layer_ids is None:\n    x = [2]\nelse:\n    x = [val + 2 for val in layer_ids]",
    "None ": "self.language_model.set_eagle3_layers_to_capture(layer_ids)",  # delegates: not read through
}


@pytest.mark.parametrize("form", list(_SETTERS))
def test_sglang_id_forms_are_read_from_the_setter(form):
    body = "\n".join("        " + ln for ln in _SETTERS[form].splitlines())
    tree = ast.parse(f"class M:\n    def set_eagle3_layers_to_capture(self, layer_ids=None):\n{body}\n")
    got, line = capture_code.sglang_form(capture_code.method(tree, "M", capture_code.SGLANG_SETTER))
    assert got == (None if form in (None, "None ") else form.strip()) and line >= 2


def test_every_form_a_rule_reads_is_the_form_of_the_classes_it_names():
    """The id form the scan reads from SGLang's own code is the one each rule with a form was read as (classes
    that delegate to an inner model, kimi_k25.py, have none)."""
    facts = SECTIONS["sglang"]["capture_code"]
    for rule in (r for r in RULES if r.engine == "sglang" and r.form and version_matches(r, Version(SGL))):
        forms = {facts[c]["form"] for c in rule.classes} - {None}
        assert forms == {rule.form}, f"{rule.source}: {forms}"


def test_qwen2_moe_on_sglang_takes_the_rule_of_its_forms_reading():
    """No rule names sglang/srt/models/qwen2_moe.py, whose setter passes [val + 1 ...] on to its model: the rule
    follows from the form, its source naming the line; vLLM's Qwen2MoeForCausalLM has no capture."""
    rule = conv.rule_for("sglang", "qwen2_moe", SGL)
    assert rule.read([1, 3], 6) == [2, 4] and rule.form == "plus_one"
    assert re.match(r"sglang/srt/models/qwen2_moe\.py:\d+: the plus_one form of sglang/srt/models/", rule.source)
    assert conv.engine_ids("sglang", "qwen2_moe", [2, 3, 4], 6, SGL) == [1, 2, 3]
    with pytest.raises(ConventionError, match=r"no EAGLE-3 capture for Qwen2MoeForCausalLM .*qwen2_moe\.py"):
        conv.rule_for("vllm", "qwen2_moe", VLLM)


def test_a_wheel_is_read_without_installing_it(tmp_path):
    """A wheel holding the installed vLLM's registry, interfaces.py and llama.py: its section gives Llama the row
    and capture-code digest the installed package gives, and says it was read from the wheel, not run."""
    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]).parent \
        if importlib.util.find_spec("vllm") else None
    if root is None:
        pytest.skip("vllm is not installed: no engine source to pack")
    wheel = tmp_path / "vllm-9.9.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for rel in ("registry.py", "interfaces.py", "llama.py"):
            z.write(root / "vllm/model_executor/models" / rel, f"vllm/model_executor/models/{rel}")
    got = capture_scan.read_wheel(wheel)["vllm"]["9.9.0"]
    assert got["read_from"] == f"wheel {wheel.name} (source read, not run)"
    arch = "LlamaForCausalLM"
    assert got["architectures"][arch] == SECTIONS["vllm"]["architectures"][arch]
    assert got["capture_code"][LLAMA["vllm"]]["digest"] == SECTIONS["vllm"]["capture_code"][LLAMA["vllm"]]["digest"]
    with pytest.raises(ValueError, match="not a wheel of"):
        capture_scan.read_wheel(tmp_path / "torch-2.0.0-py3-none-any.whl")


def test_a_release_read_from_its_wheel_takes_the_rules_of_the_same_capture_code(monkeypatch):
    """vLLM 0.33.0, read from its wheel: every family gets 0.32.0's ids (the same capture code), the source says
    it was read and not run; an unread release is refused with the command that reads it; a release whose capture
    code changed is refused until a rule is read for it."""
    assert capture_support.section("vllm", "0.33.0")["read_from"].startswith("wheel vllm-0.33.0-")
    for family, boundaries in (("llama", [0, 3, 6]), ("qwen3_moe", [2, 3, 4]), ("deepseek_v3", [1, 3, 6]),
                               ("kimi_k25", [2, 3, 4]), ("phi3", [0, 3, 6]), ("granite", [0, 3, 6]),
                               ("olmo2", [1, 3, 6])):
        assert conv.engine_ids("vllm", family, boundaries, 6, "0.33.0") == \
            conv.engine_ids("vllm", family, boundaries, 6, "0.32.0") == boundaries
    assert "vllm 0.33.0 (wheel vllm-0.33.0-" in conv.rule_for("vllm", "llama", "0.33.0").source
    with pytest.raises(ConventionError, match=r"no EAGLE-3 capture for Gemma3ForConditionalGeneration"):
        conv.rule_for("vllm", "gemma3", "0.33.0")
    with pytest.raises(ConventionError, match=r"vllm 0\.34\.0 .*source was not read.*pip download --no-deps "
                                              r"vllm==0\.34\.0 -d wheels && python -m eaglepipe\.contract\."
                                              r"capture_scan --wheel wheels/vllm-0\.34\.0-\*\.whl"):
        conv.rule_for("vllm", "llama", "0.34.0")
    changed = json.loads(json.dumps(TABLE))
    changed["vllm"]["0.33.0"]["capture_code"][LLAMA["vllm"]]["digest"] = "0" * 16
    monkeypatch.setattr(capture_support, "table", lambda: changed)
    with pytest.raises(ConventionError, match=r"vllm 0\.33\.0 .*capture code of .*llama\.py:LlamaForCausalLM"):
        conv.rule_for("vllm", "llama", "0.33.0")


# --- the engines' own predicates, imported ---------------------------------------------------------------------

_VLLM_PREDICATE = """
import json, logging
logging.disable(logging.CRITICAL)
from vllm.model_executor.models.registry import ModelRegistry
from vllm.model_executor.models.interfaces import supports_eagle3
out = {}
for arch in sorted(ModelRegistry.models):
    try:
        cls = ModelRegistry._try_load_model_cls(arch)
    except Exception:
        cls = None
    if cls is not None:
        out[arch] = bool(supports_eagle3(cls))
print("RESULT " + json.dumps(out))
"""

_SGLANG_OWNER = """
import importlib, json, logging, pkgutil
logging.disable(logging.CRITICAL)
from eaglepipe.engines import sgl_kernel_cpu_shim
sgl_kernel_cpu_shim.install()
import sglang.srt.models as pkg
out = {}
for info in pkgutil.iter_modules(pkg.__path__, "sglang.srt.models."):
    try:
        mod = importlib.import_module(info.name)
    except Exception:
        continue
    entry = getattr(mod, "EntryClass", None)
    for cls in (entry if isinstance(entry, list) else [entry] if entry else []):
        owner = next((k for k in cls.__mro__ if "set_eagle3_layers_to_capture" in vars(k)), None)
        out[cls.__name__] = None if owner is None else f"{owner.__module__}:{owner.__name__}"
print("RESULT " + json.dumps(out))
"""


def _run(script: str) -> dict:
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_table_agrees_with_vllms_supports_eagle3():
    """Every registered class that imports here: ``supports_eagle3`` (interfaces.py) says what the table says."""
    got = _run(_VLLM_PREDICATE)
    rows = SECTIONS["vllm"]["architectures"]
    assert len(got) > 150  # most of the registry imports on CPU (those needing torchvision etc. do not)
    # vllm/models/* are hardware-isolated entry points: the table reads their CUDA branch, a CPU import another
    here = {a: s for a, s in got.items() if not rows[a][0].startswith("vllm/models/")}
    wrong = {a: (s, rows[a][1]) for a, s in here.items() if s != (rows[a][1] is not None)}
    assert not wrong, f"supports_eagle3 vs table capture class: {wrong}"


@pytest.mark.sglang
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
def test_the_table_agrees_with_sglangs_classes():
    """Every SGLang model module that imports on CPU: the MRO owner of set_eagle3_layers_to_capture is the table's
    capture class (same module and name)."""
    got = _run(_SGLANG_OWNER)
    rows = SECTIONS["sglang"]["architectures"]
    assert len(got) > 100

    def dotted(cls: str | None) -> str | None:
        return None if cls is None else cls.replace(".py:", ":").replace("/", ".")

    wrong = {a: (o, rows[a][1]) for a, o in got.items() if o != dotted(rows[a][1])}
    assert not wrong, f"set_eagle3_layers_to_capture owner vs table capture class: {wrong}"


# --- real captures: families no rule lists, through vLLM, against eaglepipe's hf capture ----------------------

SEQS = [list(range(3, 40)), list(range(50, 70))]  # token ids < 99 (the tiny targets' vocabulary)


def _hf_reference(target: Path, boundaries: list[int]) -> list[torch.Tensor]:
    """eaglepipe's hf capture of h[k] for ``boundaries``, checked against transformers' own hidden_states[k] for
    k < N (index N of hidden_states is after the final norm; eaglepipe's h[N] is before it)."""
    from transformers import AutoModelForCausalLM

    from eaglepipe.engines.hf import HFEngine

    with HFEngine(target) as h:
        ref = h.capture(SEQS, boundaries)  # hf ids are boundaries (identity); per sequence (T, len, H)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    with torch.inference_mode():
        for seq, r in zip(SEQS, ref):
            hs = model.model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
            for j, k in enumerate(boundaries):
                if k < n:
                    torch.testing.assert_close(r[:, j], hs[k][0].float(), rtol=1e-5, atol=1e-5)
    return ref


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("name,boundaries", [
    ("phi3", [0, 3, 6]),  # llama.py's capture, inherited: h[0] and h[N] reachable
    ("granite", [0, 3, 6]),  # granite.py's own capture; embedding and residual multipliers ≠ 1
    ("olmo2", [1, 3, 6]),  # the Transformers backend: h[1..N]
])
def test_vllm_capture_at_the_translated_ids_is_hfs_h_k(tmp_path, name, boundaries):
    """A tiny random target (N = 6, fp32): vLLM's own capture, with the ids eaglepipe's translator gives for
    ``boundaries``, equals eaglepipe's hf h[k] (itself transformers' hidden_states[k] below N)."""
    from eaglepipe.engines.vllm import VLLMEngine
    from eaglepipe.target.tiny import build

    target = build(name, tmp_path / name)
    ref = _hf_reference(target, boundaries)
    ids = conv.engine_ids("vllm", name, boundaries, 6, VLLM)
    assert ids == boundaries  # id i = h[i] for these classes
    with VLLMEngine(target, dtype="float32", max_model_len=128, work_dir=tmp_path / "vllm") as e:
        got = e.capture(SEQS, ids)
    for g, r in zip(got, ref):
        assert g.shape == r.shape  # (T, 3, H)
        cos = torch.nn.functional.cosine_similarity(g.double(), r.double(), dim=-1)  # (T, 3)
        assert cos.min() >= 0.99999, f"{name}: min cosine per layer {cos.min(0).values.tolist()}"
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-4)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_transformers_backend_id_0_stops_the_engine_not_h0(tmp_path, capfd):
    """The trap the olmo2 rule names: id 0 makes Base.set_aux_hidden_state_layers look up layer `0 - 1`; in vLLM
    0.32.0 ``_layer_names`` is a dict, so the engine fails at start with KeyError -1 (it never feeds h[0])."""
    from eaglepipe.engines.vllm import VLLMEngine
    from eaglepipe.target.tiny import build

    target = build("olmo2", tmp_path / "olmo2")
    with pytest.raises(Exception):  # noqa: B017 — vLLM's own start-up error, whatever its class
        with VLLMEngine(target, dtype="float32", max_model_len=128, work_dir=tmp_path / "vllm") as e:
            e.capture(SEQS, [0, 3])
    seen = capfd.readouterr()
    err = seen.out + seen.err  # vLLM's engine-core and worker processes print their traceback to either
    assert "self._layer_names[layer - 1]" in err and "KeyError: -1" in err
