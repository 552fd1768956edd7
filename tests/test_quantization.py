"""Quantized serving as a knob: params name an engine's own method; one the engine/version lacks is refused."""

from pathlib import Path

import pytest
import yaml

from eaglepipe.errors import ParamsError
from eaglepipe.params import parse_params
from eaglepipe.target import quantization

REPO = Path(__file__).resolve().parents[1]


def _with(**sections) -> dict:
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for key, v in sections.items():
        if isinstance(v, dict):
            raw[key] = {**raw[key], **v}
        else:
            raw[key] = v
    return raw


def test_defaults_are_unquantized():
    p = parse_params(_with())
    assert (p.extract.quantization, p.validate_.quantization, p.serve.quantization) == (None, None, None)
    assert p.validate_.max_rel_l2 == 0.05 and p.validate_.reference


def test_fp8_on_vllm_in_bf16_is_accepted():
    p = parse_params(_with(validate={"quantization": "fp8", "engine_dtype": "bfloat16"},
                           serve={"quantization": "fp8", "engine_dtype": "bfloat16"},
                           extract={"engine": "vllm", "quantization": "fp8", "engine_dtype": "bfloat16"}))
    assert p.validate_.quantization == p.serve.quantization == p.extract.quantization == "fp8"


@pytest.mark.parametrize("sections,expect", [
    ({"extract": {"quantization": "fp8"}},  # extract.engine is hf
     "'extract.quantization' = 'fp8': the hf engine (transformers) serves no quantized target"),
    ({"framework": "hf", "validate": {"quantization": "fp8"}}, "'validate.quantization' = 'fp8': the hf engine"),
    ({"serve": {"quantization": "gguf", "engine_dtype": "bfloat16"}},
     "'serve.quantization' = 'gguf': vllm 0.32 offers no such quantization method (read from vllm's "
     "vllm/model_executor/layers/quantization/__init__.py QuantizationMethods); allowed: awq"),
    ({"validate": {"quantization": "fp8"}},  # engine_dtype float32
     "'validate.quantization' = 'fp8' with engine_dtype 'float32': vllm computes fp8 only in bfloat16 or "
     "float16"),
    ({"framework": "sglang", "serve": {"quantization": "marlin"}},
     "'serve.quantization' = 'marlin': sglang 0.5.23 offers no such quantization method (read from sglang's "
     "sglang/srt/arg_groups/choices.py QUANTIZATION_CHOICES)"),
])
def test_unoffered_quantization_is_refused_naming_key_engine_and_source(sections, expect):
    with pytest.raises(ParamsError) as e:
        parse_params(_with(**sections))
    assert expect in str(e.value)


def test_version_picks_the_row():
    assert quantization.offered("vllm", "0.26.0")[0] == "0.26" and "bitsandbytes" in quantization.offered("vllm", "0.26.0")[1]
    assert "bitsandbytes" not in quantization.offered("vllm", "0.32.0")[1]
    assert "marlin" in quantization.offered("sglang", "0.5.17")[1] and "marlin" not in quantization.offered("sglang", "0.5.23")[1]
    assert "gguf" in quantization.offered("sglang", "0.5.23")[1] and "gguf" not in quantization.offered("vllm")[1]
    quantization.check("serve.quantization", "vllm", "bitsandbytes", "bfloat16", version="0.26.0")
    with pytest.raises(ParamsError, match="vllm 0.32 offers no such"):
        quantization.check("serve.quantization", "vllm", "bitsandbytes", "bfloat16", version="0.32.1")


def test_hf_engine_refuses_quantization_directly(tiny_target):
    from eaglepipe.engines.hf import HFEngine

    with pytest.raises(ParamsError, match="hf engine .* serves no quantized target"):
        HFEngine(tiny_target, quantization="fp8")


def test_check_params_stage_exits_2(tmp_path):
    import subprocess
    import sys

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(_with(serve={"quantization": "int4"})))
    r = subprocess.run([sys.executable, str(REPO / "stages/check_params.py"), "ok.json"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "'serve.quantization' = 'int4'" in r.stderr
    assert not (tmp_path / "ok.json").exists()
