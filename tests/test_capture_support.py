"""The engines decide which targets they capture: the capture table is their code, the rules name its classes.

Fast tier: the table equals what eaglepipe/contract/capture_scan.py reads from the installed engines' files; the
scanner's class resolution on a synthetic package; every hand-listed family's engine class is one its rule was
read from; families no rule lists (phi3, granite, olmo2) resolve through the class each engine captures with.
Engine tiers: the table against the engines' own predicates at import (vLLM ``supports_eagle3``, SGLang's MRO),
and real captures of tiny phi3 / granite / olmo2 targets through vLLM against eaglepipe's hf capture.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from eaglepipe.contract import capture_scan, capture_support
from eaglepipe.contract import convention as conv
from eaglepipe.contract.rules import ANY, RULES, version_matches
from eaglepipe.errors import ConventionError

REPO = Path(__file__).resolve().parents[1]
TABLE = capture_support.table()
SGL, VLLM = TABLE["sglang"]["version"], TABLE["vllm"]["version"]
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
    index = capture_scan.SourceIndex(tmp_path)
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
    """For the installed version: each family a rule lists maps (transformers' architecture → the engine's
    registry) to a class whose capture code that rule names; a refusal rule's class captures nothing or is named
    by it; and every class a rule names is still one the engine captures with."""
    body = TABLE[engine]
    version = Version(body["version"])
    code_classes = {row[2] for row in body["architectures"].values() if row[2]}
    checked = 0
    for rule in (r for r in RULES if r.engine == engine and version_matches(r, version)):
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
        assert conv.rule_for(engine, "phi3", version) is conv.rule_for(engine, "llama", version)
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
    assert "HeliumForCausalLM" not in TABLE["vllm"]["architectures"]
    with pytest.raises(ConventionError, match=r"no model class of its own for HeliumForCausalLM .* Transformers "
                                              r"backend, dense or MoE .* refusing to guess"):
        capture_support.lookup("vllm", VLLM, "helium")


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
    rows = TABLE["vllm"]["architectures"]
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
    rows = TABLE["sglang"]["architectures"]
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
