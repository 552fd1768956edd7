"""Issue 13's scaling curve: τ against training conversations and epochs.

    train   THERE (the GPU box), after the GPU profile's extract: drafts trained on the first n shards of its
            tokens store (n · extract.shard_size conversations), with the profile's own train params, online
            as train_drafter does (eaglepipe.train.train_drafter); one JSON per n (its summary's per-epoch τ_sim).
    csv     HERE: those JSONs, the full run's reports/train.json and the served τ of its kept epoch
            (reports/serve_eval.json, benchmarks/h200/serve_*.json) → benchmarks/h200/scaling.csv with columns
            conversations, epochs, tau_sim, tau_reference, tau_vllm, tau_sglang (blank where not measured).

The subsets share the full store's shards (symlinks) under a manifest that lists only their samples, so the
features are the same computation; each draft holds out its own train.eval_fraction for τ_sim.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
COLUMNS = ["conversations", "epochs", "tau_sim", "tau_reference", "tau_vllm", "tau_sglang"]


def subset_store(features: Path, n_shards: int, out: Path) -> Path:
    """A tokens store of the first ``n_shards`` shards of ``features`` (shard files linked, manifest cut)."""
    m = json.loads((features / "manifest.json").read_text())
    shards = m["shards"][:n_shards]
    names = {s["file"] for s in shards}
    samples = [s for s in m["samples"] if s["shard"] in names]
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        link = out / name
        if not link.exists():
            link.symlink_to((features / name).resolve())
    m.update(shards=shards, samples=samples, quarantined=[q for q in m["quarantined"] if q["shard"] < n_shards],
             totals={"samples": len(samples), "tokens": sum(s["n_tokens"] for s in samples),
                     "loss_tokens": sum(s["n_loss"] for s in samples),
                     "quarantined": sum(q["shard"] < n_shards for q in m["quarantined"])})
    (out / "manifest.json").write_text(json.dumps(m))
    return out


def train(a) -> None:
    import yaml

    from eaglepipe.params import parse_params
    from eaglepipe.train import train_drafter

    p = parse_params(yaml.safe_load(Path(a.params).read_text())).train
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for n in a.shards:
        sub = subset_store(Path(a.features), n, Path(a.work) / f"store-{n}")
        t0 = time.perf_counter()
        s = train_drafter(sub, a.target, Path(a.work) / f"draft-{n}", p, scratch_dir=Path(a.work) / f"scratch-{n}")
        s.pop("losses", None)
        row = {"shards": n, "conversations": _conversations(s), "wall_s": time.perf_counter() - t0, **s}
        (out / f"scaling_{n}.json").write_text(json.dumps(row, indent=1, default=str) + "\n")
        print(f"RESULT scaling_{n} conversations {row['conversations']} best {s['best']} {row['wall_s']:.0f} s", flush=True)


def _conversations(summary: dict) -> int:
    """The store's conversations the draft was given (its train split plus the train.eval_fraction held out)."""
    return summary["samples"]["train"] + summary["samples"]["eval"]


def _epoch_rows(summary: dict, conversations: int) -> list[dict]:
    return [{"conversations": conversations, "epochs": int(k.removeprefix("epoch")) + 1, "tau_sim": v["tau_sim"]}
            for k, v in sorted(summary["evals"].items(), key=lambda kv: int(kv[0].removeprefix("epoch")))]


def to_csv(a) -> None:
    rows = []
    for f in sorted(Path(a.runs).glob("scaling_*.json")):
        s = json.loads(f.read_text())
        rows += _epoch_rows(s, s["conversations"])
    full = json.loads(Path(a.train_report).read_text())
    full_rows = _epoch_rows(full, _conversations(full))
    best = full_rows[full["best"]["epoch"]]  # the kept epoch: what was exported and served
    serve = json.loads(Path(a.serve_report).read_text()) if a.serve_report else {}
    best["tau_reference"] = serve.get("reference", {}).get("tau")
    best["tau_vllm"] = serve.get("vllm", {}).get("tau")
    if a.sglang and Path(a.sglang).exists():
        best["tau_sglang"] = json.loads(Path(a.sglang).read_text()).get("tau")
    rows += full_rows
    rows.sort(key=lambda r: (r["conversations"], r["epochs"]))
    with open(a.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else (round(r[c], 4) if isinstance(r[c], float) else r[c]))
                        for c in COLUMNS})
    print(Path(a.out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--features", default="data/features")
    t.add_argument("--target", default="data/target")
    t.add_argument("--params", default="params.yaml", help="the merged params the pipeline ran with")
    t.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    t.add_argument("--work", default="/tmp/scaling")
    t.add_argument("--out", default="/tmp/out")
    c = sub.add_parser("csv")
    c.add_argument("--runs", required=True, help="folder of the scaling_*.json files")
    c.add_argument("--train-report", required=True, help="the full run's reports/train.json")
    c.add_argument("--serve-report", default=None, help="its reports/serve_eval.json (reference, vLLM)")
    c.add_argument("--sglang", default=None, help="its SGLang serve JSON (benchmarks/h200_engines.py serve)")
    c.add_argument("--out", default="benchmarks/h200/scaling.csv")
    a = ap.parse_args()
    {"train": train, "csv": to_csv}[a.cmd](a)


if __name__ == "__main__":
    main()
