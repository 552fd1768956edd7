"""`eaglepipe probe`: a running vLLM server's acceptance, measured over its own HTTP API and metrics.

The server is the one users run (``vllm serve TARGET --speculative-config '{"method": "eagle3", ...}'``). The probe
reads its Prometheus counters (``GET /metrics``: ``vllm:spec_decode_num_drafts``, ``…_num_draft_tokens``,
``…_num_accepted_tokens``, ``…_num_accepted_tokens_per_pos`` by ``position``; vllm ``v1/spec_decode/metrics.py``),
sends the prompts as token ids to ``POST /v1/completions`` (greedy, all at once or a few at a time), reads
the counters again and takes τ = 1 + accepted / drafts and acceptance per position = accepted at it / drafts from
the difference (:func:`eaglepipe.engines.serve.vllm_acceptance`, the same arithmetic as serve_eval's). Other
clients' requests during the probe count too: probe a server nobody else is using.

Compared with an expected τ (serve_eval's or the draft's τ_sim), a server that accepts less than half as many
drafted tokens per step (τ − 1) is named, with the causes the gate knows.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from eaglepipe.engines.serve import VLLM_COUNTERS, VLLM_PER_POS, counter_delta, vllm_acceptance
from eaglepipe.errors import EaglepipeError

TIMEOUT_S = 600.0  # one request (a long completion on a slow server)
FAR_LESS = 0.5  # flagged below this share of the expected accepted tokens per step
_SAMPLE = re.compile(r'^(vllm:spec_decode_num_\w+?)(?:_total)?(?:\{([^}]*)\})?\s+(\S+)$')
CAUSES = (
    ("ids: the server feeds other boundaries than the draft was trained on "
     "(`eaglepipe inspect DRAFT --target T`, `eaglepipe diagnose DRAFT --target T`)"),
    ("numerics: a quantized target or another dtype computes other states than training read (the gate's numerics "
     "verdict, metrics/offsets.json; serve.quantization / serve.engine_dtype)"),
    "template: requests rendered with another chat template or system prompt than the training data",
)


def parse_counters(text: str) -> dict:
    """vLLM's speculative-decoding counters in Prometheus text → {"drafts", "draft_tokens", "accepted", "per_pos"}
    summed over label sets (engines, models); ``per_pos`` by the ``position`` label. Raises EaglepipeError when the
    text holds none (a server without speculative decoding, or not vLLM)."""
    out, per_pos, seen = {"drafts": 0, "draft_tokens": 0, "accepted": 0}, {}, False
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or m.group(1).endswith("_created"):
            continue
        name, labels, value = m.group(1), m.group(2) or "", int(float(m.group(3)))
        if name == VLLM_PER_POS:
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            per_pos[pos] = per_pos.get(pos, 0) + value
        elif name in VLLM_COUNTERS:
            out[VLLM_COUNTERS[name]] += value
            seen = True
    if not seen:
        raise EaglepipeError("the server's /metrics has no vllm:spec_decode_* counters: it is no vLLM server "
                             "serving a draft (--speculative-config), or its stats are off (--disable-log-stats)")
    return {**out, "per_pos": [per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1)]}


def _http(url: str, body: dict | None = None) -> str:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.read().decode()
    except (urllib.error.URLError, OSError) as e:
        raise EaglepipeError(f"{url}: {getattr(e, 'reason', e)} (is the server up?)") from None


def served_model(url: str) -> str:
    """The model id the server serves (``GET /v1/models``, the first)."""
    return json.loads(_http(f"{url}/v1/models"))["data"][0]["id"]


def probe(url: str, prompts: list[list[int]], max_new_tokens: int, expect_tau: float | None = None,
          concurrency: int | None = None) -> dict:
    """Send ``prompts`` (token ids) to the vLLM server at ``url`` (``http://host:port``), ``concurrency`` requests at
    a time (None: all at once, as serve_eval's ``serve.batch_sizes: [null]``), and measure its acceptance.

    Returns {"url", "model", "prompts", "max_new_tokens", "completion_tokens", "k", "tau", "acceptance_per_pos",
    "drafts", "draft_tokens", "accepted_tokens", "expect_tau", "verdict" ("ok" | "accepts far less" | "no
    expectation"), "causes"}. Raises EaglepipeError when the server cannot be reached or has no counters.
    """
    url = url.rstrip("/")
    if urlsplit(url).scheme not in ("http", "https"):
        raise EaglepipeError(f"{url}: give the server as http://host:port")
    model = served_model(url)
    before = parse_counters(_http(f"{url}/metrics"))

    def complete(ids: list[int]) -> int:
        body = {"model": model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0}
        return json.loads(_http(f"{url}/v1/completions", body))["usage"]["completion_tokens"]

    with ThreadPoolExecutor(max_workers=max(concurrency or len(prompts), 1)) as pool:
        tokens = sum(pool.map(complete, prompts))
    delta = counter_delta(parse_counters(_http(f"{url}/metrics")), before)
    k = len(delta["per_pos"])
    res = {"url": url, "model": model, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
           "completion_tokens": tokens, "k": k, **vllm_acceptance(delta, k), "expect_tau": expect_tau}
    if expect_tau is None:
        res.update(verdict="no expectation", causes=[])
    elif res["tau"] - 1 < FAR_LESS * (expect_tau - 1):
        res.update(verdict="accepts far less", causes=list(CAUSES))
    else:
        res.update(verdict="ok", causes=[])
    return res


def expected_tau(path: str) -> float:
    """The τ a server should reach: serve_eval's report or metrics (the vLLM τ, else the reference decoder's), or
    a number. Raises EaglepipeError when neither is found."""
    try:
        return float(path)
    except ValueError:
        pass
    from eaglepipe.target.config import read_json

    report = read_json(path)
    for name in ("vllm", "reference"):
        tau = (report.get(name) or {}).get("tau")
        if isinstance(tau, (int, float)):
            return float(tau)
    raise EaglepipeError(f"{path}: no vllm or reference τ (give serve_eval's report or metrics, or a number)")


def format_probe(r: dict) -> str:
    """The human-readable result."""
    acc = " / ".join(f"{a:.3f}" for a in r["acceptance_per_pos"])
    lines = [(f"{r['url']} ({r['model']}): {r['prompts']} prompts, {r['completion_tokens']} tokens, "
             f"{r['drafts']} drafts of k = {r['k']}"),
             f"served τ {r['tau']:.4f}, acceptance per position {acc}"]
    if r["expect_tau"] is not None:
        lines.append(f"expected τ {r['expect_tau']:.4f}: {r['verdict']}")
    lines += [f"  likely cause, {c}" for c in r["causes"]]
    return "\n".join(lines)
