"""Training tokens/s online (``extract.store: tokens``: the target computes the features inside the loop) against
offline (features read from the shards), at SmolLM2 shapes (the bundled target: N 30, H 576), same rows.

    python benchmarks/online_train.py                                   # CPU defaults (small), JSON to --out
    python benchmarks/online_train.py --target /tmp/w/target --samples 1024 --batch-tokens 16384 --fast \\
        --engine-dtype float32 bfloat16 --out $OUT/online_train.json   # a GPU (benchmarks/h200/online_train.json)

No DVC: both stores are written here, with eaglepipe's own writer and capture (random token sequences of
seeded lengths, loss on their second half; the tokens store's shards carry stand-in conversation text of the
size extract writes, ~5 bytes a token, whose parsing at each shard open cost the data thread 75-91 ms a row on
a 2-core CPU before rows were read shard by shard: benchmarks/token_reads.py), then :func:`eaglepipe.train.loop.train_drafter`
runs one epoch on each with the same params. ``tokens_per_s`` is train_drafter's own figure (token positions / seconds of the epoch
loop: reading or computing features, forward, backward, optimizer; set-up and evaluation excluded);
``wall_s`` is the whole call (online set-up includes one target forward a packed row for the top-1 mask).
``peak_gib``: torch.cuda.max_memory_allocated over the call on CUDA; ``peak_rss_mib`` the process's peak RSS
(ru_maxrss, monotone, so only the first row is that row's own). ``online_vs_offline`` = online / offline
tokens/s per engine dtype, each the best of ``--repeats`` alternating runs (the issue's target on the H200: ≥ 0.7).
Two online modes: ``online`` (train.capture_stream, the default: the next rows' capture on a CUDA stream of its
own, beside the step) and ``online_serial`` (capture_stream false: on the step's stream); on a CPU, and with
--fast on CUDA (train_drafter then compiles the capture and runs it in the training thread), they are the same
path, and their spread is run-to-run noise. ``online_vs_offline`` gives each one's ratio.
``capture_only`` rows per engine dtype time the online capture alone over one epoch's rows (no training), the
target eager and, with --fast on CUDA, its layers compiled (HFEngine(compile=True), as train_drafter runs it then).
``--random-target``: a target with SmolLM2-135M's shapes and random weights (no GGUF needed on the device).
``--profile DIR``: one more epoch of each mode (offline, online, online_serial) under torch.profiler (CPU and
CUDA activity); DIR gets each one's top operators by self CPU time and by CUDA time, and its ``*_profiled`` row
the GPU's busy share of the call (kernel time / wall time): low means the step waits on the host (launches,
Python, syncs).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.token_reads import conversation  # noqa: E402  (text the size a real store's shards hold)
from eaglepipe.data.features import FeatureSample, ShardWriter, store_capture  # noqa: E402
from eaglepipe.engines.hf import HFEngine  # noqa: E402
from eaglepipe.params import TrainParams  # noqa: E402
from eaglepipe.target.info import materialize_target, read_info  # noqa: E402
from eaglepipe.train.loop import train_drafter  # noqa: E402

LAYERS = [2, 15, 27]  # params.yaml's default for SmolLM2 (N = 30)
BUNDLED_GGUF = REPO / "bundled" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-135M's shapes (the bundled GGUF's config) for --random-target: tokens/s depends on shapes, not on
# weight values, so a device without the GGUF (or its gguf reader) times the same computation
SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
MODES = {"offline": ("features", {}), "online": ("tokens", {}),  # mode → (store, TrainParams changed)
         "online_serial": ("tokens", {"capture_stream": False})}


def sequences(n: int, min_len: int, max_len: int, vocab: int, seed: int,
              prompt_share: tuple[float, float] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n (input_ids int64 (T,), loss_mask bool (T,)) with seeded lengths in [min_len, max_len], the loss after the
    first half, or with ``prompt_share`` (lo, hi) after a seeded share in [lo, hi) of each sequence."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        prompt = T // 2
        if prompt_share:
            lo, hi = prompt_share
            prompt = int(T * (lo + (hi - lo) * float(torch.rand((), generator=g))))
        ids = torch.randint(0, vocab, (T,), generator=g)
        out.append((ids, torch.arange(T) >= prompt))
    return out


def write_stores(target: Path, work: Path, seqs, engine_dtype: str, store_dtype: str, shard_size: int) -> dict:
    """Both stores of ``seqs`` under ``work``: features (captured here, like extract) and tokens; → store → dir."""
    info = read_info(target, hash_weights=False)
    ids = LAYERS + [info.n_layers]  # hf's meaning is the boundary index itself
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    engine = HFEngine(target, dtype=engine_dtype, device=dev, batch_size=16, info=info)
    header = {"engine": "hf", "engine_version": engine.version, "layers": LAYERS, "dtype": store_dtype,
              "target": {"hash": "benchmark", "n_layers": info.n_layers, "hidden_size": info.hidden_size,
                         "vocab_size": info.vocab_size, "model_type": info.model_type, "family": info.family},
              "capture_ids": ids, "regenerate": None, "prompts_hash": "benchmark"}
    out = {}
    for store in ("features", "tokens"):
        d = work / f"{store}-{engine_dtype}"
        shutil.rmtree(d, ignore_errors=True)
        w = ShardWriter(d / "features", d / "scratch", f"bench-{store}", shard_size)
        chunks = [seqs[i : i + shard_size] for i in range(0, len(seqs), shard_size)]
        for i, chunk in enumerate(chunks):
            caps = engine.capture([t.tolist() for t, _ in chunk], ids) if store == "features" else [None] * len(chunk)
            samples = [FeatureSample(f"s{i * shard_size + j}", t, m,
                                     *(store_capture(h, store_dtype) if h is not None else (None, None)))
                       for j, ((t, m), h) in enumerate(zip(chunk, caps))]
            w.write(i, samples, messages=None if store == "features" else [conversation(len(t)) for t, _ in chunk])
        extra = {"store": store}
        if store == "tokens":
            extra.update(gate_samples=0, engine_dtype=engine_dtype)
        w.finish({**header, **extra}, len(chunks))
        out[store] = d / "features"
    engine.close()
    del engine
    return out


def fresh_run(scratch: Path) -> None:
    """Before a timed train_drafter call: the device idle, its cache emptied and peak memory reset, ``scratch``
    removed."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    shutil.rmtree(scratch, ignore_errors=True)


def run(store_dir: Path, target: Path, p: TrainParams, scratch: Path) -> dict:
    fresh_run(scratch)
    t0 = time.perf_counter()
    s = train_drafter(store_dir, target, scratch / "drafter", p, scratch_dir=scratch / "ckpt")
    wall = time.perf_counter() - t0
    return {"tokens_per_s": s["tokens_per_s"], "train_seconds": s["seconds"], "wall_s": round(wall, 2),
            "steps": s["steps"], "train_tokens": s["train_tokens"], "final_train_loss": s["final_train_loss"],
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_available() else None,
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "store_bytes": sum(f.stat().st_size for f in store_dir.glob("shard-*"))}


def capture_only(store_dir: Path, target: Path, p: TrainParams, compile: bool) -> dict:
    """The online capture alone (no training) over one epoch's packed rows, as train_drafter forms and feeds them
    (:class:`eaglepipe.train.online.OnlineCapture`, token budget 2 × batch_tokens): tokens/s with the device synced, so
    its cost inside the loop (online step − offline step) can be told from the capture's own. ``compile``: the
    target through torch.compile (HFEngine(compile=True)); two rows of warm-up (compilation) are untimed."""
    from eaglepipe.data.features import FeatureSet
    from eaglepipe.train.packing import epoch_rows
    from eaglepipe.train.online import OnlineCapture

    fs = FeatureSet(store_dir)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cap = OnlineCapture(target, fs.manifest, dev, 2 * p.batch_tokens, compile=compile)
    rows = [[fs.tokens(fs.refs[i])[0] for i in row]
            for row in epoch_rows([r.n_tokens for r in fs.refs], p.seed, 0, p.batch_tokens, p.packing)]
    t_warm = time.perf_counter()
    for row in rows[:2]:  # warm-up (and compilation)
        cap(row)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    warm = time.perf_counter() - t_warm
    t0 = time.perf_counter()
    for row in rows:
        cap(row)
    sync()
    dt = time.perf_counter() - t0
    cap.close()
    n = sum(len(t) for row in rows for t in row)
    return {"tokens_per_s": round(n / dt, 1), "seconds": round(dt, 3), "rows": len(rows), "tokens": n,
            "ms_per_row": round(1000 * dt / len(rows), 2), "warmup_s": round(warm, 2), "compiled": compile}


def profiled(store_dir: Path, target: Path, p: TrainParams, scratch: Path, out_dir: Path) -> dict:
    """One train_drafter call (the store decides offline or online) under torch.profiler: writes ``out_dir``/profile_{cpu,cuda}.txt (top 30
    operators by self CPU / self CUDA time) and returns wall seconds, kernel seconds and their ratio."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        r = run(store_dir, target, p, scratch)
    ev = prof.key_averages()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "profile_cpu.txt").write_text(ev.table(sort_by="self_cpu_time_total", row_limit=30))
    res = {"wall_s": r["wall_s"], "train_seconds": r["train_seconds"], "steps": r["steps"]}
    if torch.cuda.is_available():
        (out_dir / "profile_cuda.txt").write_text(ev.table(sort_by="self_device_time_total", row_limit=30))
        kernel_s = sum(e.device_time_total for e in prof.events()  # the kernels themselves (a CPU op's
                       if e.device_type == DeviceType.CUDA) / 1e6  # device time would count them again); µs → s
        res |= {"kernel_s": round(kernel_s, 3), "gpu_busy_share_of_wall": round(kernel_s / r["wall_s"], 3)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="SmolLM2 HF folder (made from --gguf when missing); default "
                    "$EAGLEPIPE_CACHE or .cache/smollm2-135m-instruct")
    ap.add_argument("--gguf", default=str(BUNDLED_GGUF))
    ap.add_argument("--random-target", action="store_true", help="--target made with SmolLM2-135M's shapes and "
                    "random weights (eaglepipe.target.tiny), not from --gguf")
    ap.add_argument("--work", default="/tmp/eaglepipe-online-bench")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "online_train_cpu.json"))
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--min-len", type=int, default=96)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--fast", action="store_true", help="train.fast (flex attention + torch.compile on CUDA)")
    ap.add_argument("--engine-dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--store-dtype", default="bfloat16")
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="offline, online, offline, ...; the best of each counts")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--profile", default=None, help="folder: one more epoch of each mode under torch.profiler (docstring)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.threads:
        torch.set_num_threads(a.threads)
    import os

    target = Path(a.target or Path(os.environ.get("EAGLEPIPE_CACHE", REPO / ".cache")) / "smollm2-135m-instruct")
    if not (target / "config.json").exists():
        if a.random_target:
            from eaglepipe.target.tiny import build

            build("llama", target, **SMOLLM2_SHAPES)
        else:
            materialize_target(a.gguf, target, "float32")
    info = read_info(target, hash_weights=False)
    seqs = sequences(a.samples, a.min_len, a.max_len, info.vocab_size, seed=0)
    p = TrainParams(draft_vocab_size=a.draft_vocab, ttt_steps=a.ttt, epochs=1, warmup_steps=2,
                    batch_tokens=a.batch_tokens, eval_fraction=max(1.5 / a.samples, 0.02), checkpoint_every=10**6,
                    fast=a.fast, teacher_precision="tf32" if a.fast else "fp32")
    work = Path(a.work)
    rows = []
    for engine_dtype in a.engine_dtype:
        stores = write_stores(target, work, seqs, engine_dtype, a.store_dtype, a.shard_size)
        for rep in range(a.repeats):  # alternating, so warm-up and neighbours' load fall on both modes
            for mode, (store, over) in MODES.items():
                r = run(stores[store], target, p.model_copy(update=over), work / "train")
                rows.append({"mode": mode, "engine_dtype": engine_dtype, "repeat": rep, **r})
                print(f"{mode:13s} engine {engine_dtype:9s} {r['tokens_per_s']:>10.1f} tok/s  {r['steps']} steps  "
                      f"wall {r['wall_s']} s  peak {r['peak_gib']} GiB  store {r['store_bytes'] / 2**20:.1f} MiB",
                      flush=True)
        for mode, (store, over) in MODES.items() if a.profile else ():  # before the
            pr = profiled(stores[store], target, p.model_copy(update=over), work / "train",
                          Path(a.profile) / f"{mode}_{engine_dtype}")
            rows.append({"mode": f"{mode}_profiled", "engine_dtype": engine_dtype, **pr})  # compiled capture
            print(f"profiled {mode} engine {engine_dtype}: {pr}", flush=True)
        for compiled in sorted({False, a.fast and torch.cuda.is_available()}):  # eager (as trained) and compiled
            c = capture_only(stores["tokens"], target, p, compiled)
            rows.append({"mode": "capture_only", "engine_dtype": engine_dtype, **c})
            print(f"capture  engine {engine_dtype:9s} compiled {compiled!s:5s} {c['tokens_per_s']:>10.1f} tok/s  "
                  f"{c['ms_per_row']} ms a row  warm-up {c['warmup_s']} s", flush=True)
    ratio = {}
    for engine_dtype in a.engine_dtype:
        by = {mode: max(r["tokens_per_s"] for r in rows if (r["engine_dtype"], r["mode"]) == (engine_dtype, mode))
              for mode in MODES}
        ratio[engine_dtype] = {m: round(by[m] / by["offline"], 3) if by["offline"] else None
                               for m in MODES if m != "offline"}
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    res = {"device": dev, "torch": torch.__version__, "target": ("SmolLM2-135M shapes, random weights" if a.random_target else "SmolLM2-135M-Instruct")
           + " (N 30, H 576)",
           "layers": LAYERS, "store_dtype": a.store_dtype,
           "setting": {"repeats": a.repeats, "samples": a.samples, "lengths": [a.min_len, a.max_len], "batch_tokens": a.batch_tokens,
                       "ttt_steps": a.ttt, "draft_vocab_size": a.draft_vocab, "fast": a.fast, "epochs": 1},
           "rows": rows, "online_vs_offline": ratio}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"RESULT online_train {json.dumps({'device': dev, 'online_vs_offline': ratio})}", flush=True)


if __name__ == "__main__":
    main()
