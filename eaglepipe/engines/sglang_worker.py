"""The SGLang worker process and its pipe protocol (the process side of :class:`.sglang.SGLangEngine`).

Why a process: SGLang's ``Engine`` sets the global multiprocessing start method, installs signal handlers and
starts a scheduler and a detokenizer process; on CPU it also needs the stand-ins of :mod:`.sgl_kernel_cpu_shim`
installed before its code is imported. So the caller's process never imports sglang: :class:`Worker` starts
``python -m eaglepipe.engines.sglang FD`` (the entry point at the bottom of that file, which also re-installs
the stand-ins in SGLang's own spawned children) and talks to :func:`worker_main` over a socket pair.

Protocol: the driver sends ``(op, kwargs)``, the worker answers ``("ok", result)`` or ``("error",
traceback)``; ops are ``start`` (one ``sglang.Engine`` with these server arguments, stopping the previous
one), ``capture``, ``generate``, ``stop`` and ``exit``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection

import torch

from eaglepipe.errors import CaptureMismatch, EaglepipeError

# The module run as the worker (``python -m``): its ``__main__`` / ``__mp_main__`` block installs the CPU
# stand-ins before anything imports sglang, in the worker and in every process SGLang spawns from it.
WORKER_MODULE = "eaglepipe.engines.sglang"
# Set to "1" in the worker's environment (inherited by SGLang's subprocesses) when the CPU stand-ins apply.
SHIM_ENV = "EAGLEPIPE_SGLANG_CPU_SHIM"
# The Python interpreter that runs the worker (default: this process's own). SGLang may live in a virtual
# environment of its own (scripts/setup.sh's GPU route: .venv-sglang, its torch pin differs from vLLM's); that
# environment must hold eaglepipe too (the worker runs ``python -m eaglepipe.engines.sglang``).
PYTHON_ENV = "EAGLEPIPE_SGLANG_PYTHON"


class SGLangError(EaglepipeError):
    """SGLang failed inside its worker; the message carries the worker's traceback."""


# ------------------------------------------------------------------------------------------ the worker side


def _hidden_rows(entries: list, n_tokens: int, rid: int) -> torch.Tensor:
    """Prompt rows of SGLang's ``meta_info["hidden_states"]``: float32 (T, D).

    SGLang appends one 2-D entry per prefill chunk (``(chunk_len, D)``) and one 1-D entry per decode step;
    the prompt's rows are the 2-D entries in order.
    """
    chunks = [torch.tensor(e, dtype=torch.float32) for e in entries if e and isinstance(e[0], list)]
    rows = torch.cat(chunks) if chunks else torch.empty(0)  # (T, D)
    if rows.shape[0] != n_tokens:
        raise CaptureMismatch(
            f"sequence {rid}: SGLang returned hidden states for {rows.shape[0]} prompt tokens, expected "
            f"{n_tokens} (a cached prefix is not recomputed; is the radix cache on?)"
        )
    return rows


def _capture(engine, sequences: list[list[int]]) -> list:
    """Prefill each sequence (one sampled token, discarded); its aux states per prompt token, numpy (T, D)."""
    outs = engine.generate(input_ids=sequences, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                           return_hidden_states=True)
    return [_hidden_rows(out["meta_info"]["hidden_states"], len(seq), j).numpy()
            for j, (seq, out) in enumerate(zip(sequences, outs))]


def _generate(engine, prompts: list[list[int]], sampling_params) -> dict:
    """Completions, SGLang's per-request ``spec_*`` / ``completion_tokens`` meta, and the seconds they took."""
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=sampling_params)
    return {
        "outputs": [list(out["output_ids"]) for out in outs],
        "meta": [{key: value for key, value in out["meta_info"].items() if key.startswith(("spec_", "completion"))}
                 for out in outs],
        "seconds": time.perf_counter() - t0,
    }


def worker_main(conn: Connection) -> None:
    """The worker process: owns one ``sglang.Engine`` at a time; answers (op, kwargs) messages on ``conn``."""
    import sglang
    from sglang.srt.entrypoints.engine import Engine as SGLEngine

    engine = None

    def stop():
        nonlocal engine
        if engine is not None:
            engine.shutdown()
            engine = None

    while True:
        try:
            op, kw = conn.recv()
        except EOFError:  # the driving process is gone
            stop()
            return
        try:
            if op == "start":
                stop()
                t0 = time.perf_counter()
                engine = SGLEngine(**kw)
                result = {"startup_s": time.perf_counter() - t0, "version": sglang.__version__}
            elif op == "capture":
                result = _capture(engine, kw["sequences"])
            elif op == "generate":
                result = _generate(engine, kw["prompts"], kw["sampling_params"])
            elif op in ("stop", "exit"):
                stop()
                result = None
            else:
                raise ValueError(f"unknown op {op!r}")
            conn.send(("ok", result))
            if op == "exit":
                return
        except BaseException:  # noqa: BLE001 — everything goes back to the caller, the worker lives on
            conn.send(("error", traceback.format_exc()))


# ------------------------------------------------------------------------------------------ the driver side


def worker_python() -> str:
    """The worker's interpreter: ``$EAGLEPIPE_SGLANG_PYTHON`` when set (a path, or a name looked up on PATH),
    else ``sys.executable``. Raises SGLangError naming the variable when it names no executable file."""
    value = os.environ.get(PYTHON_ENV)
    if not value:
        return sys.executable
    path = shutil.which(value)
    if path is None:
        raise SGLangError(
            f"{PYTHON_ENV}={value!r} is not an executable file: it names the Python interpreter that runs the "
            f"SGLang worker (its environment needs sglang and eaglepipe); unset it to use {sys.executable}"
        )
    return path


class Worker:
    """The driver's handle on one worker process, started on the first :meth:`call`.

    Args:
        device: "cpu" installs the CPU stand-ins and SGLang's CPU branches in the worker's environment.
        timeout: seconds one request may take before the worker is declared hung and killed.
    """

    def __init__(self, device: str, timeout: float):
        self.device = device
        self.timeout = timeout
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._python: str | None = None  # the interpreter of the running worker

    @property
    def running(self) -> bool:
        return self._proc is not None

    def _spawn(self) -> None:
        """Start ``python -m eaglepipe.engines.sglang FD`` (python: :func:`worker_python`) with one end of a
        socket pair as its pipe."""
        python = worker_python()
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ, HF_HUB_OFFLINE="1")  # targets are local folders; never reach for a hub
        env[SHIM_ENV] = "1" if self.device == "cpu" else "0"
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's CPU branches (without it: GPU paths, vllm imports)
        fd = child_sock.fileno()
        self._proc = subprocess.Popen(
            [python, "-m", WORKER_MODULE, str(fd)], env=env, pass_fds=(fd,), start_new_session=True,
        )
        self._python = python
        child_sock.close()
        self._conn = Connection(parent_sock.detach())

    def call(self, op: str, **kw):
        """Send one request and return its result. Raises SGLangError (SGLang's traceback, a hung or dead
        worker: then killed, and the next call starts a new one)."""
        if self._proc is None:
            self._spawn()
        try:
            self._conn.send((op, kw))
            if not self._conn.poll(self.timeout):
                self.kill()
                raise SGLangError(f"SGLang worker gave no answer to {op!r} within {self.timeout:.0f} s; killed it")
            status, result = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):  # gone (e.g. its interpreter could not run it)
            code = self._proc.wait(10)
            self.kill()
            raise SGLangError(f"SGLang worker died during {op!r} (exit code {code}; interpreter {self._python}, "
                              f"{PYTHON_ENV} chooses it)") from None
        if status == "error":
            raise SGLangError(f"SGLang failed during {op!r} (worker traceback follows)\n{result}")
        return result

    def kill(self) -> None:
        """Kill the worker and every process SGLang started under it."""
        if self._proc is not None:
            if self._proc.poll() is None:
                try:
                    os.killpg(self._proc.pid, signal.SIGKILL)  # the worker leads its own process group
                except ProcessLookupError:
                    pass
            self._proc.wait(10)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def close(self) -> None:
        """Stop SGLang and the worker (gracefully, else by killing its process group). Safe to call twice."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._conn.send(("exit", {}))
                if self._conn.poll(60):
                    self._conn.recv()
                self._proc.wait(30)
            except (OSError, EOFError, subprocess.TimeoutExpired):
                pass
        self.kill()
