#!/usr/bin/env bash
# Benchmark of one TTT training step (benchmarks/train_step.py) on the lent H200, which has no network: the peer
# trainers and their missing pure-Python deps travel as wheels in .whl/ (speculators 0.9.0, specforge 0.2.0,
# pydantic, pydantic-settings, loguru, ...; fetched with `pip download --no-deps`, see the device README).
# Usage, in the repo root on the device: bash scripts/gpu_bench_train.sh [train_step.py args]
# Writes benchmarks/h200/train_step.json (+ train_step_checks.json with --checks), copied with the log to $OUT.
# The device tool sends the session's main checkout; from another worktree, copy it (tracked files + .whl/) into
# an ignored folder of that checkout, e.g. .gpu-train/, carry it, and run: cd .gpu-train && bash scripts/gpu_bench_train.sh
# Runs used for the committed figures (one command each, ≤ 10 min):
#   --checks --shapes A --ttt 3 7 ;  --shapes B --ttt 3 7 --iters 5 --warmup 2 ;  --shapes A/B --iters 4 --warmup 2
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-/tmp/out}"
mkdir -p "$OUTDIR"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
trap 'cp benchmarks/h200/train_step*.json "$OUTDIR"/ 2>/dev/null || true' EXIT
python3 benchmarks/train_step.py --peer-path /tmp/site "$@" 2>&1 | tee "$OUTDIR/train_step.log"
