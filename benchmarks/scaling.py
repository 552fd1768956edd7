"""Issue 13's scaling curve: τ against training conversations and epochs.

    train   on the GPU, after the GPU profile's extract: drafts trained on the first n shards of its
            tokens store (n · extract.shard_size conversations), with the profile's own train params, online
            as train_drafter does (eaglepipe.train.loop.train_drafter); one JSON per n (its summary's per-epoch τ_sim).
    csv     HERE: those JSONs (and full runs' reports/train.json, if they ran) and the served τ of a draft's
            kept epoch (--served) → benchmarks/h200/scaling.csv with columns conversations, epochs, tau_sim,
            tau_reference, tau_vllm, tau_sglang (blank where not measured), then tau_sim_mtbench (the kept
            epoch's τ_sim on the 80 MT-bench first turns, benchmarks/sim_gap.py: where held-out τ_sim and
            served τ part, this says which) and tokens_per_epoch (the training split's token positions an
            epoch: two runs on the same conversations, one with later turns kept (prompts.max_turns), differ
            there), and draft_mlp (the draft MLP's width: the target's, or train.draft_intermediate_size);
            `render` draws it as a PNG.

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
COLUMNS = ["conversations", "epochs", "tau_sim", "tau_reference", "tau_vllm", "tau_sglang", "tau_sim_mtbench",
           "tokens_per_epoch", "draft_mlp"]  # draft_mlp: the draft MLP's width (train.draft_intermediate_size)
MEASURES = {"vllm": "tau", "sglang": "tau", "reference": "tau", "sim_mtbench": "tau_sim"}  # --served ENGINE: its key


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
    from eaglepipe.train.loop import train_drafter
    from eaglepipe.profiles import apply_sets

    # e.g. train.draft_vocab_size=32768: the levers issue 13 asks to measure
    p = parse_params(apply_sets(yaml.safe_load(Path(a.params).read_text()), a.set)).train
    tag = "".join(f"_{kv.removeprefix('train.').replace('=', '')}" for kv in a.set)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for n in a.shards:
        sub = subset_store(Path(a.features), n, Path(a.work) / f"store-{n}")
        t0 = time.perf_counter()
        s = train_drafter(sub, a.target, Path(a.work) / f"draft-{n}{tag}", p,
                          scratch_dir=Path(a.work) / f"scratch-{n}{tag}")
        s.pop("losses", None)
        row = {"shards": n, "conversations": _conversations(s), "wall_s": time.perf_counter() - t0,
               "set": a.set, **s}
        (out / f"scaling_{n}{tag}.json").write_text(json.dumps(row, indent=1, default=str) + "\n")
        print(f"RESULT scaling_{n}{tag} conversations {row['conversations']} best {s['best']} {row['wall_s']:.0f} s", flush=True)


def _conversations(summary: dict) -> int:
    """The store's conversations the draft was given (its train split plus the train.eval_fraction held out)."""
    return summary["samples"]["train"] + summary["samples"]["eval"]


def _tokens_per_epoch(summary: dict) -> int:
    return round(summary["train_tokens"] / len(summary["evals"]))


def _epoch_rows(summary: dict, conversations: int) -> list[dict]:
    t, mlp = _tokens_per_epoch(summary), summary["draft"]["intermediate_size"]
    return [{"conversations": conversations, "epochs": int(k.removeprefix("epoch")) + 1, "tau_sim": v["tau_sim"],
             "tokens_per_epoch": t, "draft_mlp": mlp}
            for k, v in sorted(summary["evals"].items(), key=lambda kv: int(kv[0].removeprefix("epoch")))]


def _run_of(best: dict, key: str) -> tuple:
    """The one run whose conversations or tokens_per_epoch is ``key`` ("N", or "N/MLP" to name the draft MLP's
    width too); ValueError if none or several."""
    n, _, mlp = key.partition("/")
    hits = [k for k in best if int(n) in k[:2] and (not mlp or int(mlp) == k[2])]
    if len(hits) != 1:
        raise ValueError(f"--served key {key}: {len(hits)} runs match {sorted(best)} (conversations, "
                         "tokens_per_epoch, draft_mlp); give the tokens_per_epoch of the one meant, and /MLP")
    return hits[0]


def to_csv(a) -> None:
    runs = [r for r in (json.loads(f.read_text()) for f in sorted(Path(a.runs).glob("scaling_*.json")))
            if not r.get("set")]  # the curve is of the profile's own settings; --set runs are compared apart
    runs += [json.loads(Path(f).read_text()) for f in a.train_report]  # full runs (stages/train_drafter.py's report)
    rows, best = [], {}
    for s in runs:
        n = _conversations(s)
        rows += _epoch_rows(s, n)
        best[(n, _tokens_per_epoch(s), s["draft"]["intermediate_size"])] = \
            rows[len(rows) - len(s["evals"]) + s["best"]["epoch"]]  # the exported epoch
    for spec in a.served:  # ENGINE:KEY[/MLP]:FILE[#a.b], a served, reference or sim_gap result of that run's draft
        engine, key, f = spec.split(":", 2)
        if engine not in MEASURES:
            raise ValueError(f"--served {spec}: ENGINE is one of {sorted(MEASURES)}, not {engine!r}")
        f, _, path = f.partition("#")
        r = json.loads(Path(f).read_text())
        for k in filter(None, path.split(".")):  # a result inside a larger JSON
            r = r[k]
        r = r.get(engine, r) if engine == "reference" else r  # serve_eval's report holds each engine's result
        best[_run_of(best, key)][f"tau_{engine}"] = r[MEASURES[engine]]
    rows.sort(key=lambda r: (r["conversations"], r["tokens_per_epoch"], r["draft_mlp"], r["epochs"]))
    with open(a.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else (round(r[c], 4) if isinstance(r[c], float) else r[c]))
                        for c in COLUMNS})
    print(Path(a.out).read_text())


COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (23, 190, 207), (188, 189, 34), (227, 119, 194)]
SERVED = ("tau_reference", "tau_vllm", "tau_sglang", "tau_sim_mtbench")  # drawn as squares (served), triangle (sim)


def _run(r: dict) -> tuple[int, int, int]:
    return int(r["conversations"]), int(r["tokens_per_epoch"]), int(r["draft_mlp"])


def _axes(d, box, lo: float, hi: float, xs: list[float], xlabel: str, title: str):
    """Axes in box (x0, y0, x1, y1) for τ in [lo, hi] and x ticks xs (labels given as (x, text)); → the y map."""
    x0, y0, x1, y1 = box
    y = lambda t: y1 - (t - lo) / (hi - lo) * (y1 - y0)  # noqa: E731
    d.line([(x0, y1), (x1, y1)], fill="black"), d.line([(x0, y1), (x0, y0)], fill="black")
    for t in [lo + i * 0.25 for i in range(int((hi - lo) / 0.25) + 1)]:
        d.text((x0 - 52, y(t) - 6), f"{t:.2f}", fill="black"), d.line([(x0, y(t)), (x1, y(t))], fill=(225, 225, 225))
    for x, text in xs:
        d.text((x - 8, y1 + 6), text, fill="black")
    d.text(((x0 + x1) // 2 - 40, y1 + 24), xlabel, fill="black")
    d.text((x0, y0 - 28), title, fill="black")
    return y


def _marker(d, px: float, py: float, col: str, c) -> None:
    if col == "tau_sim_mtbench":  # a simulation, not a serving: a triangle
        d.polygon([(px, py - 5), (px - 5, py + 4), (px + 5, py + 4)], outline=c, width=2)
    else:
        d.rectangle([px - 4, py - 4, px + 4, py + 4], outline=c, width=2)


def render(a) -> None:
    """benchmarks/h200/scaling.csv → PNG, two panels: τ_sim per epoch, one line per run (served τ as squares,
    MT-bench τ_sim as triangles); below, each run's exported epoch against its conversations (log scale)."""
    import math

    from PIL import Image, ImageDraw

    rows = list(csv.DictReader(open(a.csv)))
    w, h, pad = 1000, 900, 60
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    taus = [float(r[c]) for r in rows for c in COLUMNS if c.startswith("tau_") and r[c]]
    lo, hi = 1.0, max(taus + [2.0]) + 0.1
    runs = sorted({_run(r) for r in rows})
    base_mlp = min(k[2] for k in runs)  # the target's width; a wider draft MLP is labelled
    epochs = max(int(r["epochs"]) for r in rows)
    x = lambda e: pad + (e - 1) / max(epochs - 1, 1) * (w - 5 * pad)  # noqa: E731
    y = _axes(d, (pad, pad, w - 4 * pad, 430), lo, hi, [(x(e), str(e)) for e in range(1, epochs + 1)], "epochs",
              a.title)
    for i, key in enumerate(runs):
        c, mine = COLOURS[i % len(COLOURS)], [r for r in rows if _run(r) == key]
        d.line([(x(int(r["epochs"])), y(float(r["tau_sim"]))) for r in mine], fill=c, width=2)
        wide = f", MLP {key[2]}" if key[2] != base_mlp else ""
        d.text((w - 2 * pad - 30, 40 + 36 * i), f"{key[0]} conv.{wide}\n{key[1] / 1e6:.2f}M tok/epoch", fill=c)
        for r in mine:
            for col in SERVED:
                if r.get(col):
                    _marker(d, x(int(r["epochs"])), y(float(r[col])), col, c)
    kept = [r for r in rows if any(r.get(col) for col in SERVED)]  # the exported epochs that were measured
    cs = [int(r["conversations"]) for r in kept]
    lx = lambda n: pad + (math.log2(n) - math.log2(min(cs))) / max(math.log2(max(cs) / min(cs)), 1) * (w - 5 * pad)  # noqa: E731
    y = _axes(d, (pad, 520, w - 4 * pad, h - pad), lo, hi, [(lx(n), str(n)) for n in sorted(set(cs))],
              "training conversations (log scale)", "the exported epoch: held-out tau_sim (dot), MT-bench tau_sim "
              "(triangle), served tau (squares: vLLM, SGLang)")
    for n in sorted(set(cs)):  # labels stacked per conversation count, from its highest marker down
        group = [r for r in kept if int(r["conversations"]) == n]
        px, ty = lx(n), min(y(max(float(r[col]) for col in SERVED if r.get(col))) for r in group) - 6
        for r in group:
            c = COLOURS[runs.index(_run(r)) % len(COLOURS)]
            d.ellipse([px - 3, y(float(r["tau_sim"])) - 3, px + 3, y(float(r["tau_sim"])) + 3], fill=c)
            for col in sorted((col for col in SERVED if r.get(col)), key=lambda col: -float(r[col])):
                _marker(d, px, y(float(r[col])), col, c)
                d.text((px + 8, ty), f"{col.removeprefix('tau_')} {float(r[col]):.3f}", fill=c)
                ty += 13
    d.text((w - 3 * pad, 540), "target's tau = 2.5 at k = 3\n(issue 13)", fill="black")
    d.line([(pad, y(2.5)), (w - 4 * pad, y(2.5))], fill=(120, 120, 120))
    img.save(a.out)
    print(f"wrote {a.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--features", default="data/features")
    t.add_argument("--target", default="data/target")
    t.add_argument("--params", default="params.yaml", help="the merged params the pipeline ran with")
    t.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    t.add_argument("--set", nargs="*", default=[], metavar="train.KEY=VALUE",
                   help="train params over the profile's (e.g. train.draft_vocab_size=32768 train.ttt_steps=7)")
    t.add_argument("--work", default="/tmp/scaling")
    t.add_argument("--out", default="/tmp/out")
    c = sub.add_parser("csv")
    c.add_argument("--runs", required=True, help="folder of the scaling_*.json files")
    c.add_argument("--train-report", nargs="*", default=[], help="full runs' reports/train.json")
    c.add_argument("--served", nargs="*", default=[], metavar="ENGINE:KEY[/MLP]:FILE",
                   help="served τ of the draft of the run whose conversations (or, where two runs share them, "
                   "tokens_per_epoch; /MLP: and whose draft MLP is that wide) is KEY: ENGINE vllm | sglang (a "
                   "serve_eagle3 result JSON), reference (a serve_eval report or reference JSON) or "
                   "sim_mtbench (a benchmarks/sim_gap.py JSON); FILE#a.b takes the result at keys a, b of FILE")
    c.add_argument("--out", default="benchmarks/h200/scaling.csv")
    r = sub.add_parser("render")
    r.add_argument("--csv", default="benchmarks/h200/scaling.csv")
    r.add_argument("--out", default="benchmarks/h200/scaling.png")
    r.add_argument("--title", default="EAGLE-3 draft for SmolLM2-135M, H200: tau_sim (held-out ShareGPT) per "
                   "epoch; squares: served tau (MT-bench, k=3); triangles: tau_sim on MT-bench")
    a = ap.parse_args()
    {"train": train, "csv": to_csv, "render": render}[a.cmd](a)


if __name__ == "__main__":
    main()
