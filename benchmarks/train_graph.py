"""Epoch time of ``train_drafter`` with the GPU profile's training params, the eager fast step against the whole
step as one CUDA graph (``train.cuda_graph``), offline (a features store) and online (a tokens store: the target
computes the features in the loop), at SmolLM2-135M's shapes, same rows.

    python benchmarks/train_graph.py --out benchmarks/h200/train_graph.json          # a CUDA GPU
    python benchmarks/train_graph.py --samples 48 --epochs 1 --out /tmp/g.json       # CPU: both rows eager

Params: params.yaml with profiles/gpu.yaml merged (eaglepipe.profiles, as ``eaglepipe profile`` gives DVC), then
``--epochs``, and checkpoints off. Data: ``--samples`` random token sequences with seeded lengths in
[``--min-len``, ``--max-len``] and a seeded prompt share (loss on the rest), so rows differ in how many positions
are trained, as ShareGPT's do; both stores are written by benchmarks/online_train.py's ``write_stores`` (the hf
engine's capture). The target has SmolLM2-135M's shapes and random weights (speed depends on shapes only).
Each run is one train_drafter call in this process, modes alternating ``--repeats`` times. A row gives
train_drafter's own ``epoch_seconds`` (each epoch's training loop: reading or computing features, the step,
the optimizer; evaluation and set-up excluded; the first epoch includes compilation and, graphed, one capture
per new row shape), the steady epoch (the last), ``cuda_graphs`` captured, final loss, peak GPU memory, and the
whole call's wall time. ``speedup`` = eager / graphed seconds of the last epoch, per store. The JSON is rewritten
after every run, so a run cut short keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.online_train import SMOLLM2_SHAPES, fresh_run, sequences, write_stores  # noqa: E402
from eaglepipe.params import parse_params  # noqa: E402
from eaglepipe.profiles import merge_profile  # noqa: E402
from eaglepipe.target.info import read_info  # noqa: E402
from eaglepipe.train.loop import train_drafter  # noqa: E402

MODES = {"offline_eager": ("features", False), "offline_graph": ("features", True),  # mode → (store, cuda_graph)
         "online_eager": ("tokens", False), "online_graph": ("tokens", True)}


def gpu_profile_train(epochs: int):
    """params.yaml's ``train`` with profiles/gpu.yaml's merged over it, ``epochs`` set, checkpoints off."""
    raw = merge_profile(yaml.safe_load((REPO / "params.yaml").read_text()),
                        yaml.safe_load((REPO / "profiles" / "gpu.yaml").read_text()))
    return parse_params(raw).train.model_copy(update={"epochs": epochs, "checkpoint_every": 10**6})


def run(store_dir: Path, target: Path, p, scratch: Path) -> dict:
    cuda = torch.cuda.is_available()
    fresh_run(scratch)
    t0 = time.perf_counter()
    s = train_drafter(store_dir, target, scratch / "drafter", p, scratch_dir=scratch / "ckpt")
    return {"epoch_seconds": s["epoch_seconds"], "last_epoch_s": s["epoch_seconds"][-1],
            "tokens_per_epoch": s["train_tokens"] // len(s["epoch_seconds"]), "steps": s["steps"],
            "cuda_graphs": s["cuda_graphs"], "final_train_loss": s["final_train_loss"],
            "tau_sim": [e["tau_sim"] for e in s["evals"].values()], "wall_s": round(time.perf_counter() - t0, 2),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="/tmp/smol-random", help="made with SmolLM2-135M's shapes when missing")
    ap.add_argument("--work", default="/tmp/eaglepipe-graph-bench")
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    target, work = Path(a.target), Path(a.work)
    if not (target / "config.json").exists():
        from eaglepipe.target.tiny import build

        build("llama", target, **SMOLLM2_SHAPES)
    p = gpu_profile_train(a.epochs)
    engine_dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    seqs = sequences(a.samples, a.min_len, a.max_len, read_info(target, hash_weights=False).vocab_size, seed=0,
                     prompt_share=(0.1, 0.9))
    stores = write_stores(target, work, seqs, engine_dtype, "bfloat16", 256)
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    res = {"device": dev, "torch": torch.__version__, "target": "SmolLM2-135M shapes, random weights (N 30, H 576)",
           "train": p.model_dump(), "engine_dtype": engine_dtype,
           "data": {"samples": a.samples, "lengths": [a.min_len, a.max_len], "prompt_share": [0.1, 0.9]},
           "rows": [], "speedup_last_epoch": {}}
    for rep in range(a.repeats):
        for mode in a.modes:
            store, graph = MODES[mode]
            r = run(stores[store], target, p.model_copy(update={"cuda_graph": graph}), work / "train")
            res["rows"].append({"mode": mode, "repeat": rep, **r})
            print(f"{mode:14s} epochs {r['epoch_seconds']} s  graphs {r['cuda_graphs']}  loss "
                  f"{r['final_train_loss']:.4f}  peak {r['peak_gib']} GiB  wall {r['wall_s']} s", flush=True)
            for store_kind in ("offline", "online"):
                best = {g: min((x["last_epoch_s"] for x in res["rows"] if x["mode"] == f"{store_kind}_{g}"),
                               default=None) for g in ("eager", "graph")}
                if best["eager"] and best["graph"]:
                    res["speedup_last_epoch"][store_kind] = round(best["eager"] / best["graph"], 3)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"RESULT train_graph {json.dumps({'device': dev, 'speedup_last_epoch': res['speedup_last_epoch']})}")


if __name__ == "__main__":
    main()
