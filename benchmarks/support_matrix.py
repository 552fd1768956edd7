"""Which target families eaglepipe serves, measured: tiny random target → ... → export → inspect, per engine.

Usage: python benchmarks/support_matrix.py [--out metrics/support_matrix.json] [--families a,b] [--engines hf,vllm]
                                          [--merge]
``--merge`` replaces only the rows of ``--families`` in the existing ``--out`` (same engine versions required) and
adds this run's seconds to its total, so new families are measured without rerunning the others.

For each family of :data:`eaglepipe.target.tiny.FAMILIES` and each target of :data:`WRAPPED` (multimodal wrappers
and pre-quantized checkpoints; N = 6, layers h[2], h[3], h[4]): the target stage (materialize_target), extract
(stored features: through hf, or for a pre-quantized checkpoint through vLLM, its serving kernels, since the hf
engine is refused for it), train a few steps, export_all, and
``eaglepipe inspect`` on the vLLM folder; then, per engine, that engine's own capture with the exported ids
(in a subprocess with a time limit, so one engine crashing on one family costs one row) compared with the
stored features by validate_offsets' check (offset search ±1). Rows::

    {"family", "rope_type", "engine", "status": "verified" | "refused" | "not_run", "reason", "min_cosine",
     "offset", "ids", "seconds"}

"verified": the engine's capture with the ids the export wrote matched the stored features at offset 0
(cosine ≥ 0.999). "refused": eaglepipe refuses it, the reason names the engine source (when eaglepipe refuses
the target before any engine, e.g. a RoPE the draft cannot copy, each engine's row gives that engine's own
verdict first). "not_run": the engine could not run the check here (the reason is its error, and what would run
it).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eaglepipe.engine_table import NAMES as ENGINES  # noqa: E402
from eaglepipe.errors import EaglepipeError  # noqa: E402
from eaglepipe.target.tiny import (FAMILIES, build, build_compressed, build_kimi_k25, build_qwen2_5_vl,  # noqa: E402
                                   tiny_conversations)

LAYERS = [2, 3, 4]
MIN_COSINE = 0.999
TIMEOUT_S = 420
WHERE_ELSE = {"sglang": "a CUDA machine with sglang-kernel, where the CUDA and triton kernels SGLang calls run "
                         "(flashinfer/fa3/triton attention for MLA and attention sinks, triton fused MoE gates)",
              "vllm": "a CUDA machine with vLLM"}


def _compressed(scheme: str):
    def make(out: Path) -> Path:  # the tiny llama, then quantized as llmcompressor saves it
        return build_compressed(build("llama", out.parent / "float"), out, scheme)
    return make


WRAPPED = {  # target → (builder of its folder, the engine that extracts its features)
    "qwen2_5_vl": (build_qwen2_5_vl, "hf"),
    "kimi_k25": (build_kimi_k25, "hf"),
    "llama-w8a8": (_compressed("W8A8"), "vllm"),
    "llama-fp8": (_compressed("FP8_DYNAMIC"), "vllm"),
}


def _conversations(n: int) -> list[dict]:
    return tiny_conversations(n, answer_words=5)


def prepare(name: str, work: Path) -> dict:
    """Target → extract (hf) → train (a few steps) → export → inspect for one family. Returns a summary."""
    from eaglepipe.contract.inspect import inspect_draft
    from eaglepipe.data.extract import extract
    from eaglepipe.params import ExtractParams, TrainParams
    from eaglepipe.serving.export import export_all
    from eaglepipe.target.info import materialize_target
    from eaglepipe.train.loop import train_drafter

    make, engine = WRAPPED.get(name, (lambda out: build(name, out), "hf"))
    info = materialize_target(str(make(work / "src")), work / "target")
    p = ExtractParams(engine=engine, regenerate=False, batch_size=4, max_length=64, dtype="float32", shard_size=8)
    extract(_conversations(8), work / "target", info, LAYERS, p, work / "features", work / "scratch", name)
    tp = TrainParams(draft_vocab_size=64, epochs=1, batch_tokens=128, warmup_steps=1, eval_fraction=0.25)
    train_drafter(work / "features", work / "target", work / "drafter", tp, scratch_dir=work / "scratch_train")
    verdict = export_all(work / "drafter", work / "target", work / "export", LAYERS, "hf")
    report = inspect_draft(work / "export" / "vllm", work / "target") if verdict["vllm"]["exported"] else None
    return {"family": info.family, "rope_type": info.rope["rope_type"], "export": verdict,
            "inspect_ok": None if report is None else report.ok,
            "inspect_problems": [] if report is None else report.problems}


def verify(engine: str, work: Path) -> dict:
    """``engine``'s own capture with the exported ids vs the stored features (runs in its own process)."""
    from eaglepipe.contract import convention, draft_config
    from eaglepipe.contract.validate import check_offsets
    from eaglepipe.data.features import FeatureSet
    from eaglepipe.engines import get_engine
    from eaglepipe.target.info import read_info

    info = read_info(work / "target", hash_weights=False)
    fs = FeatureSet(work / "features")
    if engine != "hf":
        exported = json.loads((work / "export" / engine / "config.json").read_text())
        ids = draft_config.config_ids(exported, engine, runner="v1")[0]
    else:
        ids = convention.engine_ids("hf", info.family, LAYERS, info.n_layers)
    opts = {"max_model_len": 128} if engine == "vllm" else {"max_total_tokens": 1024} if engine == "sglang" else {}
    with get_engine(engine, work / "target", dtype="float32", **opts) as e:
        rep = check_offsets(e, info.family, info.n_layers, fs.layers, fs.take(2), 1, MIN_COSINE)
    assert [r.engine_id for r in rep.layers] == ids, (ids, [r.engine_id for r in rep.layers])
    return {"ok": rep.ok, "min_cosine": min(r.cosine for r in rep.layers),
            "offset": max((r.best_offset for r in rep.layers), key=abs), "ids": ids, "version": rep.engine_version,
            "message": rep.message()}


def _row(summary: dict, engine: str, status: str, reason: str = "", **kw) -> dict:
    return {"family": summary["name"].split("-")[0], "target": summary["name"], "rope_type": summary.get("rope_type"), "engine": engine, "status": status,
            "reason": reason, "min_cosine": kw.get("min_cosine"), "offset": kw.get("offset"),
            "ids": kw.get("ids"), "seconds": kw.get("seconds")}


_ERR = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:ERROR [^\]]*\] )?(\w+(?:Error|Exception)):(?: (.*))?$")
WRAPPERS = ("Error raised in subprocess",)  # vLLM's registry re-raising a subprocess's error: its cause follows
_FILE = re.compile(r'File ".*?site-packages/([^"]+)", line (\d+), in (\w+)')


def _root_cause(text: str) -> str:
    """The first exception raised inside the engine (not eaglepipe's wrapper), with the engine source line."""
    lines = [ln.strip() for ln in text.splitlines()]
    where = ""
    for i, ln in enumerate(lines):
        f = _FILE.search(ln)
        if f:
            where = f"{f.group(1)}:{f.group(2)} {f.group(3)}"
        m = _ERR.match(ln)
        if m and m.group(1) not in ("SGLangError", "EaglepipeError") and "initialization failed" not in ln:
            said = m.group(2) or next((x for x in lines[i + 1:] if x), "")  # transformers' ImportError: text below
            if not said.startswith(WRAPPERS):
                return f"{m.group(1)}: {said[:300]} ({where})"
    tail = [ln for ln in lines if ln]
    return (tail[-1] if tail else "no output")[:400]


def run_engine(summary: dict, engine: str, work: Path) -> dict:
    """One (family, engine) row: refused by the export plan, verified/failed by a capture, or not_run."""
    plan = summary["export"].get(engine)
    if plan is not None and not plan["exported"]:
        return _row(summary, engine, "refused", plan["reason"])
    if engine == "hf":
        from eaglepipe.target.info import refuse_hf_on_quantized
        try:
            refuse_hf_on_quantized(work / "target", ["its capture here"])
        except EaglepipeError as e:
            return _row(summary, engine, "refused", str(e))
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--verify", engine, str(work)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO)
    except subprocess.TimeoutExpired:
        return _row(summary, engine, "not_run", f"{engine} capture did not finish in {TIMEOUT_S} s on this "
                    f"2-core CPU machine; would run on {WHERE_ELSE.get(engine, 'a larger machine')}")
    secs = round(time.perf_counter() - t0, 1)
    out = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not out:
        why = _root_cause(r.stderr + "\n" + r.stdout)
        return _row(summary, engine, "not_run", f"{engine}'s CPU path cannot run this target here: {why}; would run on "
                    f"{WHERE_ELSE.get(engine, 'another machine')}", seconds=secs)
    got = json.loads(out[-1][len("RESULT "):])
    status = "verified" if got["ok"] else "failed"
    return _row(summary, engine, status, got["message"], min_cosine=round(got["min_cosine"], 6),
                offset=got["offset"], ids=got["ids"], seconds=secs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "metrics" / "support_matrix.json"))
    ap.add_argument("--families", default=",".join([*FAMILIES, *WRAPPED]))
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--verify", nargs=2, metavar=("ENGINE", "WORK"))
    ap.add_argument("--merge", action="store_true", help="replace only these families' rows in --out")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.verify:
        print("RESULT " + json.dumps(verify(a.verify[0], Path(a.verify[1]))), flush=True)
        return
    rows, t_all = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="support_matrix_") as tmp:
        for name in a.families.split(","):
            work = Path(tmp) / name
            summary = {"name": name, "rope_type": FAMILIES[name][3] if name in FAMILIES else None}
            try:
                summary.update(prepare(name, work))
            except EaglepipeError as e:
                rows += [_row(summary, eng, "refused", _engine_verdict(eng, work, str(e)))
                         for eng in a.engines.split(",")]
                continue
            except Exception as e:  # noqa: BLE001 — a row saying what broke, the other families still run
                logging.exception("family %s", name)
                rows += [_row(summary, eng, "not_run", f"eaglepipe failed before the engine check: "
                              f"{type(e).__name__}: {str(e)[:300]}") for eng in a.engines.split(",")]
                continue
            for eng in a.engines.split(","):
                rows.append(run_engine(summary, eng, work))
                print(json.dumps(rows[-1]), flush=True)
            if summary.get("inspect_ok") is False:
                rows[-1]["reason"] += f" | inspect: {summary['inspect_problems']}"
    doc = {"produced_by": "python benchmarks/support_matrix.py", "layers": LAYERS, "min_cosine": MIN_COSINE,
           "seconds": round(time.perf_counter() - t_all, 1), "versions": _versions(), "rows": rows}
    if a.merge:
        doc = merge(json.loads(Path(a.out).read_text()), doc)
    for r in doc["rows"]:  # the run's temporary folder says nothing: the target's own name stays
        if r["reason"]:
            r["reason"] = re.sub(r"/\S*?/support_matrix_[^/]+/", "", r["reason"])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


def merge(old: dict, new: dict) -> dict:
    """``old`` with the rows of ``new``'s targets replaced (others kept, in order; new targets appended) and the
    seconds summed. Raises SystemExit when the engine versions differ: one table, one set of versions."""
    if old["versions"] != new["versions"] or old["layers"] != new["layers"]:
        raise SystemExit(f"cannot merge: {old['versions']} / {old['layers']} measured, this run "
                         f"{new['versions']} / {new['layers']}; rerun every family")
    targets = {r["target"] for r in new["rows"]}
    rows = [r for r in old["rows"] if r["target"] not in targets] + new["rows"]
    return {**old, "seconds": round(old["seconds"] + new["seconds"], 1), "rows": rows}


def _engine_verdict(engine: str, work: Path, why: str) -> str:
    """For a target eaglepipe refused before any engine ran: ``engine``'s own verdict on its family first
    (:func:`eaglepipe.contract.convention.rule_for`, naming the engine source), then eaglepipe's reason."""
    from eaglepipe.contract import convention
    from eaglepipe.errors import ConventionError
    from eaglepipe.target.config import read_target_config

    try:
        convention.rule_for(engine, convention.family_of(read_target_config(work / "src")))
    except ConventionError as e:
        return f"{e}; also: {why}"
    return why


def _versions() -> dict:
    from eaglepipe.engines import engine_version

    return {e: engine_version(e) for e in ENGINES} | {"torch": engine_version_of("torch")}


def engine_version_of(dist: str) -> str | None:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    main()
