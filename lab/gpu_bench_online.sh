#!/usr/bin/env bash
# Online vs offline training tokens/s (benchmarks/online_train.py, issue 11) on the lent H200 in ONE device call,
# without the engine carries: the target has SmolLM2-135M's shapes and random weights (--random-target), and the
# only packages the image lacks are pydantic's four wheels.
#   HERE:   bash lab/gpu_bench_online.sh fetch       # the wheels into the ignored .gpu/pyd/ (py3.12, x86_64)
#   THERE:  run carry [".gpu/pyd"], command "bash lab/gpu_bench_online.sh [online_train.py args]"
# Default args are the ninth window's (2026-12-03, 93 s on a warm machine, ~115 s from cold):
#   --samples 1024 --min-len 256 --max-len 1024 --batch-tokens 16384 --fast --engine-dtype bfloat16 --repeats 3
# Writes $OUT/online_train.json (→ benchmarks/h200/online_train.json) and $OUT/online.log.
set -euo pipefail
cd "$(dirname "$0")/.."
W=.gpu/pyd
if [ "${1:-}" = fetch ]; then
  mkdir -p $W
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d $W \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  ls $W; exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
OUTDIR="${OUT:-/tmp/out}"; mkdir -p "$OUTDIR"
[ $# -gt 0 ] || set -- --samples 1024 --min-len 256 --max-len 1024 --batch-tokens 16384 --fast \
  --engine-dtype bfloat16 --repeats 3
set -o pipefail
python3 benchmarks/online_train.py --random-target --target /tmp/smol --work /tmp/online \
  --out "$OUTDIR/online_train.json" "$@" 2>&1 | grep -v "Loading weights\|Writing model" | tee "$OUTDIR/online.log" |
  grep "tok/s\|RESULT\|Error"
