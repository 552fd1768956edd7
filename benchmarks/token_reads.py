"""Host cost of reading a tokens store's packed rows (online training's data thread), per row and per sample.

Usage: python benchmarks/token_reads.py [WORK_DIR] [OUT_JSON]
(defaults: a temp folder, benchmarks/token_reads.json)

Builds a tokens store shaped like the GPU profile's (`profiles/gpu.yaml`: 16 shards of 1,024 samples, 64–512
tokens, each shard's metadata holding its conversations' text as extract writes it, ~5 bytes a token: the
H200 store held 13.86 bytes a token, 9 of them token ids and masks) with :class:`eaglepipe.data.features.ShardWriter`,
then reads one epoch of :func:`eaglepipe.train.packing.epoch_rows` (length packing, 16,384 tokens a row) as the data
thread does, token ids and masks only:

- ``per_sample``: :meth:`FeatureSet.tokens` for each sample in row order (train.py's data thread before
  :meth:`FeatureSet.tokens_many`): a row mixes samples of every shard, and with 2 shards open at most nearly
  every sample reopens one, parsing its header (the conversations' text) again;
- ``tokens_many``: :meth:`FeatureSet.tokens_many` (what the data thread does now): the row's samples read shard
  by shard, each shard opened once a row.

Runs on CPU; no model is involved. Reports ms a row, shard opens a row, and the header size of a shard.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eaglepipe.data.features import FeatureSample, FeatureSet, ShardWriter  # noqa: E402
from eaglepipe.train.packing import epoch_rows  # noqa: E402

SHARDS, SHARD, BATCH_TOKENS, TEXT_BYTES_PER_TOKEN = 16, 1024, 16384, 5


def conversation(n_tokens: int) -> list[dict]:
    """A stand-in conversation of ``n_tokens`` tokens' worth of text, as a tokens store's shard metadata holds it."""
    text = "x" * (TEXT_BYTES_PER_TOKEN * n_tokens // 2)
    return [{"role": "user", "content": text}, {"role": "assistant", "content": text}]


def build(folder: Path) -> None:
    """A tokens store of SHARDS × SHARD seeded random samples, each with a conversation of that many bytes."""
    g = torch.Generator().manual_seed(0)
    w = ShardWriter(folder, folder.parent / ".scratch", "bench", SHARD)
    for i in range(SHARDS):
        samples, messages = [], []
        for j in range(SHARD):
            T = int(torch.randint(64, 513, (1,), generator=g))
            samples.append(FeatureSample(f"s{i * SHARD + j}", torch.randint(0, 49152, (T,), generator=g),
                                         torch.arange(T) >= T // 3, None, None))
            messages.append(conversation(T))
        w.write(i, samples, messages=messages)
    w.finish({"layers": [2, 15, 27], "target": {"n_layers": 30}, "dtype": "bfloat16", "store": "tokens",
              "gate_samples": 0}, SHARDS)


class CountingSet(FeatureSet):
    """FeatureSet counting the shards it opens (``opens``)."""

    opens = 0

    def shard(self, name: str):
        if name not in self._open:
            self.opens += 1
        return super().shard(name)


def measure(folder: Path, mode: str, max_open: int | None = None) -> dict:
    fs = CountingSet(folder) if max_open is None else CountingSet(folder, max_open=max_open)
    rows = [[fs.refs[i] for i in row]
            for row in epoch_rows([r.n_tokens for r in fs.refs], 0, 0, BATCH_TOKENS, "length")]
    t0 = time.perf_counter()
    for row in rows:
        got = [fs.tokens(r) for r in row] if mode == "per_sample" else fs.tokens_many(row)
        assert [len(ids) for ids, _ in got] == [r.n_tokens for r in row]
    dt = time.perf_counter() - t0
    n = sum(len(row) for row in rows)
    return {"mode": mode, "max_open": fs.max_open, "rows": len(rows), "samples": n, "seconds": round(dt, 3),
            "ms_per_row": round(1000 * dt / len(rows), 2), "us_per_sample": round(1e6 * dt / n, 1),
            "shard_opens_per_row": round(fs.opens / len(rows), 1)}


def main() -> None:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="eaglepipe-token-reads-"))
    out = Path(sys.argv[2] if len(sys.argv) > 2 else REPO / "benchmarks" / "token_reads.json")
    folder = work / "features"
    if not (folder / "manifest.json").exists():
        build(folder)
    shard = next(folder.glob("shard-*.safetensors"))
    header = int.from_bytes(shard.read_bytes()[:8], "little")
    rows = [measure(folder, mode, max_open) for _ in range(2)
            for mode, max_open in (("per_sample", 2), ("tokens_many", 2), ("tokens_many", None))]
    res = {"what": "reading one epoch's packed rows of a tokens store, token ids and masks only "
                   "(benchmarks/token_reads.py)",
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, "
                      f"torch {torch.__version__}",
           "store": {"shards": SHARDS, "samples_per_shard": SHARD, "sample_tokens": "64-512 uniform",
                     "header_bytes_per_shard": header, "batch_tokens": BATCH_TOKENS},
           "rows": rows}
    out.write_text(json.dumps(res, indent=1) + "\n")
    for r in rows:
        print(f"{r['mode']:12s} max_open {r['max_open']:2d} {r['ms_per_row']:8.2f} ms a row  {r['shard_opens_per_row']:5.1f} opens a row  "
              f"{r['us_per_sample']:7.1f} µs a sample", flush=True)


if __name__ == "__main__":
    main()
