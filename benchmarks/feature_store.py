"""Peak host memory of training-data loading, 1× and 10× the data: the streamed store against all-in-RAM.

Usage: python benchmarks/feature_store.py [WORK_DIR] [OUT_JSON]
(defaults: a temp folder, benchmarks/feature_store.json)

Builds a synthetic feature store at SmolLM2 shapes (3 aux layers + h[N], hidden 576, bfloat16, samples of
64–512 tokens, 64 samples a shard) with :class:`eaglepipe.data.features.ShardWriter`, at 1× (``BASE`` samples) and
10×. For each (mode, scale) a fresh subprocess reads one training epoch of packed rows (``batch_tokens`` 2048,
the default) and reports its peak RSS (``ru_maxrss``) and the RSS after imports (``/proc/self/status`` VmHWM / VmRSS):

- ``stream``: what train.py does now — :class:`eaglepipe.train.stream.BatchStream` (worker thread, memory-mapped
  shard slices, at most 2 shards open, 4 batches prefetched) over :func:`eaglepipe.train.packing.epoch_rows`;
- ``in_memory``: what train.py did before — ``list(FeatureSet(dir))``, every feature in RAM, then the same
  rows collated from memory.

Also reports the padding fraction (empty share of rows × batch_tokens) of greedy packing in shuffled order
against length-grouped packing, on the 10× lengths. Runs on CPU; no model is involved.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eaglepipe.data.features import FeatureSample, FeatureSet, ShardWriter  # noqa: E402
from eaglepipe.train.packing import collate, epoch_rows, pack, padding_fraction  # noqa: E402
from eaglepipe.train.stream import BatchStream  # noqa: E402

BASE, SHARD, L, H, BATCH_TOKENS = 128, 64, 3, 576, 2048


def status_mib(field: str) -> float:
    """A /proc/self/status field in MiB: VmRSS (now) or VmHWM (peak of this process image; unlike ru_maxrss it
    does not carry the parent's peak across exec)."""
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def build(folder: Path, n: int) -> None:
    """A store of ``n`` random samples (seeded), written shard by shard so building needs little memory."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 513, (n,), generator=g).tolist()
    w = ShardWriter(folder, folder.parent / f".scratch-{folder.name}", "bench", SHARD)
    n_shards = (n + SHARD - 1) // SHARD
    for i in range(n_shards):
        samples = []
        for j in range(i * SHARD, min(n, (i + 1) * SHARD)):
            T = lengths[j]
            samples.append(FeatureSample(
                f"s{j}", torch.randint(0, 49152, (T,), generator=g), torch.rand(T, generator=g) > 0.3,
                torch.randn(T, L, H, generator=g).to(torch.bfloat16), torch.randn(T, H, generator=g).to(torch.bfloat16)))
        w.write(i, samples)
    w.finish({"layers": [2, 15, 27], "target": {"n_layers": 30}, "dtype": "bfloat16"}, n_shards)


def measure(folder: Path, mode: str) -> dict:
    """One epoch of rows read in ``mode``; runs inside the child process."""
    base = status_mib("VmRSS")
    t0 = time.perf_counter()
    fs = FeatureSet(folder)
    lengths = [r.n_tokens for r in fs.refs]
    rows = epoch_rows(lengths, 0, 0, BATCH_TOKENS, "length")
    tokens = 0
    if mode == "stream":
        for _, b in BatchStream(folder, [[fs.refs[i] for i in row] for row in rows]):
            tokens += b.input_ids.numel()
    else:
        samples = list(fs)
        for row in rows:
            tokens += collate([samples[i] for i in row]).input_ids.numel()
    dt = time.perf_counter() - t0
    peak = status_mib("VmHWM")
    return {"mode": mode, "samples": len(fs), "tokens": tokens, "batches": len(rows),
            "store_mib": round(sum(s["bytes"] for s in fs.manifest["shards"]) / 2**20, 1),
            "rss_after_imports_mib": round(base, 1), "peak_rss_mib": round(peak, 1),
            "peak_above_imports_mib": round(peak - base, 1), "seconds": round(dt, 2),
            "tokens_per_s": round(tokens / dt)}


def main() -> None:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="feature-store-bench-"))
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else REPO / "benchmarks" / "feature_store.json"
    rows = []
    for scale in (1, 10):
        folder = work / f"x{scale}"
        if not (folder / "manifest.json").exists():
            t0 = time.perf_counter()
            build(folder, BASE * scale)
            print(f"built {folder} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        for mode in ("stream", "in_memory"):
            r = subprocess.run([sys.executable, __file__, "--child", str(folder), mode], check=True,
                               capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            row = {"scale": scale, **json.loads(r.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    lengths = [r.n_tokens for r in FeatureSet(work / "x10").refs]
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = pack(lengths, order, BATCH_TOKENS)
    grouped = epoch_rows(lengths, 0, 0, BATCH_TOKENS, "length")
    result = {
        "what": "peak RSS of reading one training epoch of packed rows from the feature store (benchmarks/feature_store.py)",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, torch {torch.__version__}, CPU",
        "shape": {"aux_layers": L, "hidden": H, "dtype": "bfloat16", "sample_tokens": "64-512 uniform",
                  "shard_samples": SHARD, "batch_tokens": BATCH_TOKENS},
        "rows": rows,
        "padding_fraction": {"greedy_shuffled": round(padding_fraction(lengths, greedy, BATCH_TOKENS), 4),
                             "length_grouped": round(padding_fraction(lengths, grouped, BATCH_TOKENS), 4),
                             "rows_greedy": len(greedy), "rows_length_grouped": len(grouped)},
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'scale':>5} {'mode':>10} {'store MiB':>10} {'peak RSS MiB':>13} {'above imports':>14} {'tok/s':>9}")
    for r in rows:
        print(f"{r['scale']:>5} {r['mode']:>10} {r['store_mib']:>10} {r['peak_rss_mib']:>13} "
              f"{r['peak_above_imports_mib']:>14} {r['tokens_per_s']:>9}")
    print("padding fraction:", result["padding_fraction"])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        torch.set_num_threads(1)
        print(json.dumps(measure(Path(sys.argv[2]), sys.argv[3])))
    else:
        main()
