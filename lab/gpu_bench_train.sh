#!/usr/bin/env bash
# Benchmark of one TTT training step (benchmarks/train_step.py) on the lent H200, which has no network: the peer
# trainers and their missing pure-Python deps travel as wheels in .whl/ (speculators 0.9.0, specforge 0.2.0,
# pydantic, pydantic-settings, loguru, ...; fetched with `pip download --no-deps`, see lab/README.md).
# Usage, in the repo root on the device: bash lab/gpu_bench_train.sh [train_step.py args]
# Writes benchmarks/h200/train_step.json (+ train_step_checks.json with --checks), copied with the log to $OUT.
# The device tool sends the session's main checkout; from another worktree, copy it (tracked files + .whl/) into
# an ignored folder of that checkout, e.g. .gpu-train/, carry it, and run: cd .gpu-train && bash lab/gpu_bench_train.sh
# Runs used for the committed figures (one command each, ≤ 10 min):
#   --checks --shapes A --ttt 3 7 ;  --shapes B --ttt 3 7 --iters 5 --warmup 2 ;  --shapes A/B --iters 4 --warmup 2
#   HERE, once: bash lab/gpu_bench_train.sh fetch   (the wheels into the ignored .whl/, ~5 MiB; then carry ".whl")
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = fetch ]; then  # speculators 0.9.0 + what its draft step imports and the image lacks (METADATA's
  # Requires-Dist less the image's packages; openai, datasets, hs_connectors are stubbed by train_step.py)
  grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl speculators==0.9.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
    pydantic-settings==2.16.3 python-dotenv==1.2.4 loguru==0.7.3 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
    pygments==2.21.0 typer==0.29.2 shellingham==1.5.4 annotated-doc==0.0.4
  ls .whl; exit 0
fi
OUTDIR="${OUT:-/tmp/out}"
mkdir -p "$OUTDIR"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
trap 'cp benchmarks/h200/train_step*.json "$OUTDIR"/ 2>/dev/null || true' EXIT
python3 benchmarks/train_step.py --peer-path /tmp/site "$@" 2>&1 | tee "$OUTDIR/train_step.log"
