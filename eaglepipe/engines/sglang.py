"""The ``sglang`` engine: SGLang's own code (``sglang.Engine``; 0.5.23 and 0.5.17) behind Engine.

Ids are SGLang's own, passed through untouched exactly as a draft's ``config.json`` would hand them to
SGLang (its model class's ``set_eagle3_layers_to_capture`` makes of them what it makes); which boundary h[k]
each id is, per family and version, is :data:`eaglepipe.contract.convention.RULES` alone.

Capture path: the one that feeds a drafter at serving time. The target runs in SGLang's capture-only
EAGLE-3 mode (server args ``enable_return_aux_hidden_states=True``, ``speculative_algorithm="EAGLE3"``
naming the convention, ``return_aux_hidden_state_layer_ids=ids``): SGLang calls the model's
``set_eagle3_layers_to_capture(ids)``, and each request with ``return_hidden_states=True`` receives, per
prompt token, the concatenated aux states (``(T, len(ids)·H)``) in place of the last hidden state. A
prefill with ``max_new_tokens=1`` (the sampled token is discarded); the radix cache is off, so every token
is recomputed and captured. SGLang 0.5.17 has no capture-only mode: there real EAGLE-3 with a
probe draft captures the same ids through the serving code path (:mod:`.sglang_probe`).

Processes: SGLang runs in a worker process of its own, driven through a pipe (:mod:`.sglang_worker`: why,
and the protocol); the caller's process never imports sglang. The worker keeps sglang imported between
instances; one SGLang instance ("mode") runs at a time:

- ``("capture", ids)``: capture-only mode for exactly those ids. The ids are server arguments, so other ids
  need a new instance (~20–40 s on 2 cores) unless ``capture_ids`` declared a superset up front and the
  superset gives every requested id the same meaning (:func:`eaglepipe.contract.convention.same_meaning` decides).
- ``("generate",)``: a plain instance. ``generate`` reuses a running capture instance instead of starting
  one (capture-only mode records aux states but leaves sampling untouched).
- EAGLE-3 serving (:func:`eaglepipe.engines.serve.serve_eagle3`): CUDA only — SGLang's EAGLE-3
  worker needs its GPU kernels (tree building/verification, draft KV bookkeeping: the ``*_cpu`` ops of
  sgl_kernel that the shim refuses).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from eaglepipe.contract import convention, draft_config
from eaglepipe.engine_table import expert_parallel_refusal
from eaglepipe.engines import serve
from eaglepipe.engines.base import Engine, cpu_groups
from eaglepipe.engines.serve import groups
from eaglepipe.engines.sglang_probe import capture_server_args
from eaglepipe.engines.sglang_worker import SHIM_ENV, SGLangError, Worker, worker_main
from eaglepipe.errors import ConventionError, ParamsError, ServingUnavailable

log = logging.getLogger(__name__)


# JSON object of extra ``sglang.Engine`` server arguments for every instance, for runs that start engines
# through the stages (e.g. '{"attention_backend": "triton"}' where sgl_kernel's FA3 is not installed);
# ``engine_kwargs`` wins.
SERVER_ARGS_ENV = "EAGLEPIPE_SGLANG_ARGS"
CPU_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"  # one core group per tensor-parallel rank on CPU (cpu_groups)


class SGLangServingUnavailable(SGLangError, ServingUnavailable):
    """SGLang's EAGLE-3 serving needs CUDA (its sgl_kernel GPU kernels); raised before anything starts."""


# ------------------------------------------------------------------------------------------ the engine


def draft_layer_ids(draft_dir: str | Path) -> list[int] | None:
    """The ids SGLang reads from a draft: nested ``eagle_config.eagle_aux_hidden_state_layer_ids`` only.

    None when absent (SGLang then uses the model's default, h[2], h[N//2], h[N-3]). Mirrors
    ``_resolve_eagle_aux_hidden_state`` (srt/model_executor/model_runner_components/spec_aux_hidden_state.py).
    """
    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    ids, _ = draft_config.config_ids(cfg, "sglang")
    return ids


class SGLangEngine(Engine):
    """A target served by SGLang (see the module docstring for processes and modes).

    Args:
        target_dir: HF folder of the target.
        dtype: "float32" | "bfloat16" | "float16" (fp32 for parity; bf16 is slower on CPUs without it).
        device: "cpu" | "cuda"; default: cuda when torch sees one. On CPU the stand-ins of
            :mod:`.sgl_kernel_cpu_shim` are installed in SGLang's processes and attention is SGLang's
            ``torch_native`` backend.
        max_total_tokens: KV-cache slots (also the longest sequence; fp32 SmolLM2: ~46 KB per token).
        capture_ids: ids (SGLang meaning) recorded in addition to those asked for, so that later
            ``capture`` calls with a subset reuse one instance (only where the subset keeps its meaning).
        seed: SGLang's ``random_seed``.
        tensor_parallel_size: SGLang's ``tp_size`` in every mode; on CPU ``SGLANG_CPU_OMP_THREADS_BIND`` gives
            each rank one core group of this process's cores (:func:`eaglepipe.engines.base.cpu_groups`).
        expert_parallel: SGLang's ``ep_size`` = ``tp_size`` in every mode: an MoE target's experts split over the
            tensor-parallel ranks (SGLang's EP group lives inside its TP group:
            sglang/srt/arg_groups/parallel_hook.py; each rank holds ``num_experts / ep_size`` whole experts,
            sglang/srt/layers/moe/fused_moe_triton/layer.py). Params refuse it on a dense target and at
            tensor_parallel_size 1 first (eaglepipe/params.py, stages/target.py). Raises ParamsError on a CPU,
            where SGLang's CPU MoE cannot run it (:func:`eaglepipe.engine_table.expert_parallel_refusal`).
        log_level: SGLang's log level inside the worker ("error" keeps test output clean).
        start_timeout: seconds one request to the worker may take before it is declared hung.
        engine_kwargs: further ``sglang.Engine`` server arguments for every instance, over those in the
            environment variable ``EAGLEPIPE_SGLANG_ARGS`` (JSON).
        quantization: SGLang's ``quantization`` server argument for the target (e.g. "fp8"; names checked by
            :mod:`eaglepipe.target.quantization`).
    Attributes:
        startup_s: seconds the last start of each mode took, e.g. {"capture": 31.2}.
        n_layers: N of the target.
    """

    name = "sglang"

    def __init__(
        self, target_dir, dtype: str = "float32", device: str | None = None, max_total_tokens: int = 8192,
        capture_ids: list[int] | None = None, seed: int = 0, log_level: str = "error",
        start_timeout: float = 900, engine_kwargs: dict | None = None, info=None,
        quantization: str | None = None, tensor_parallel_size: int = 1, expert_parallel: bool = False, **_,
    ):
        super().__init__(target_dir, dtype, info)
        self.quantization = quantization
        self.tensor_parallel_size = tensor_parallel_size
        self.expert_parallel = expert_parallel
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # stages/target.py refuses it first; a direct caller here (ParamsError, not a crashed worker)
        if expert_parallel and (why := expert_parallel_refusal("sglang", self.device == "cuda")):
            raise ParamsError(f"expert_parallel: {why}")
        self.max_total_tokens = max_total_tokens
        self.capture_ids = sorted(set(capture_ids or []))
        self.seed = seed
        self.log_level = log_level
        self.engine_kwargs = {**json.loads(os.environ.get(SERVER_ARGS_ENV) or "{}"), **(engine_kwargs or {})}
        if quantization is not None:
            self.engine_kwargs["quantization"] = quantization
        self.startup_s: dict[str, float] = {}
        self._version: str | None = None
        self._worker = Worker(self.device, start_timeout)
        self._mode: tuple | None = None

    @property
    def version(self) -> str:
        return self._version or super().version

    # ---------------------------------------------------------------- instances (one worker, :mod:`.sglang_worker`)

    def _call(self, op: str, **kw):
        try:
            return self._worker.call(op, **kw)
        finally:
            if not self._worker.running:  # killed (hung or dead): no instance runs any more
                self._mode = None

    def _start(self, mode: tuple, **server_args) -> None:
        """Make ``mode`` the running SGLang instance (stopping another one first) and time its start."""
        if self._mode == mode:
            return
        kw = dict(
            model_path=str(self.target_dir), device=self.device, dtype=self.dtype, random_seed=self.seed,
            disable_radix_cache=True, max_total_tokens=self.max_total_tokens, log_level=self.log_level,
            tp_size=self.tensor_parallel_size,
        )
        if self.expert_parallel:
            kw["ep_size"] = self.tensor_parallel_size
        if self.device == "cpu":  # one core group per rank, set before the worker (and its ranks) start
            os.environ[CPU_BIND_ENV] = cpu_groups(self.tensor_parallel_size)
        kw.update(self.engine_kwargs)
        kw.update(server_args)
        self._mode = None
        res = self._call("start", **kw)
        self.startup_s[mode[0]] = res["startup_s"]
        self._version = res["version"]
        self._mode = mode
        log.info("sglang %s instance started in %.1f s", mode[0], res["startup_s"])

    def close(self) -> None:
        """Stop SGLang and its worker (gracefully, else by killing its process group). Safe to call twice."""
        self._worker.close()
        self._mode = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---------------------------------------------------------------- capture

    def _same_meaning(self, ids: list[int], recorded: list[int]) -> bool:
        return convention.same_meaning("sglang", self.info.family, ids, recorded, self.n_layers)

    def _capture_instance(self, ids: list[int]) -> list[int]:
        """Start (or reuse) a capture-only instance that records ``ids``; returns the ids it records."""
        if self._mode and self._mode[0] == "capture" and self._same_meaning(ids, list(self._mode[1])):
            return list(self._mode[1])
        recorded = sorted(set(ids) | set(self.capture_ids))
        if not self._same_meaning(ids, recorded):
            recorded = list(ids)
        # SGLang's capture-only EAGLE-3 mode where it exists (0.5.23), else EAGLE-3 with a probe draft (0.5.17)
        self._start(("capture", tuple(recorded)), **capture_server_args(
            self.target_dir, recorded, Path(tempfile.gettempdir()) / "eaglepipe-sglang", self.dtype))
        return recorded

    def capture(self, sequences: list[list[int]], ids: list[int]) -> list[torch.Tensor]:
        """What SGLang feeds an EAGLE-3 drafter for ``ids`` (SGLang meaning), per sequence float32 (T, len(ids), H).

        Raises ValueError for ids that are not strictly ascending or outside SGLang's accepted [0, N)
        (SGLang's own check; an id whose layer the model cannot capture, e.g. N-1 for llama, fails at
        the first forward inside SGLang), SGLangError when SGLang fails, CaptureMismatch when it returns
        another number of rows than tokens sent.
        """
        ids = list(ids)
        if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= self.n_layers:
            raise ValueError(
                f"sglang capture: ids {ids} must be strictly ascending within [0, {self.n_layers}) "
                f"(SGLang's --return-aux-hidden-state-layer-ids check; N = {self.n_layers})"
            )
        recorded = self._capture_instance(ids)
        cols = torch.tensor([recorded.index(i) for i in ids])  # recorded order → requested order
        rows = self._call("capture", sequences=[list(map(int, s)) for s in sequences])
        out = []
        for r in rows:
            hs = torch.from_numpy(r)  # (T, len(recorded) * H), SGLang's concatenation
            hs = hs.view(hs.shape[0], len(recorded), -1)  # (T, len(recorded), H)
            out.append(hs[:, cols].contiguous())  # (T, len(ids), H)
        return out

    def capture_for_draft(self, sequences: list[list[int]], draft_dir: str | Path) -> list[torch.Tensor]:
        """What SGLang would feed the draft in ``draft_dir``: :meth:`capture` with its nested ids."""
        ids = draft_layer_ids(draft_dir)
        if ids is None:
            raise ConventionError(
                f"{draft_dir}/config.json has no {draft_config.NESTED_FIELD}: SGLang would use its default"
            )
        return self.capture(sequences, ids)

    # ---------------------------------------------------------------- generation

    @staticmethod
    def _sampling(n: int, max_new_tokens: int, temperature: float, seed: int) -> list[dict]:
        if temperature <= 0:
            return [{"max_new_tokens": max_new_tokens, "temperature": 0.0}] * n
        # One seed per prompt (seed + index): reproducible, and two equal prompts still get two samples.
        return [{"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": 1.0, "top_k": -1,
                 "sampling_seed": seed + i} for i in range(n)]

    def start_generation(self) -> None:
        """Start the instance generate uses now (a capture instance also generates), not at the first call."""
        if self._mode is None or self._mode[0] not in ("capture", "generate"):
            self._start(("generate",))

    def generate(self, prompts, max_new_tokens, temperature=0.0, seed=0):
        """Complete each prompt (token ids) through ``sglang.Engine.generate``; greedy when temperature is 0.

        SGLang stops at the model's EOS (generation_config) and includes it in ``output_ids``.
        """
        self.start_generation()
        res = self._call("generate", prompts=[list(map(int, prompt)) for prompt in prompts],
                         sampling_params=self._sampling(len(prompts), max_new_tokens, temperature, seed))
        return res["outputs"]

    def generate_timed(self, prompts, max_new_tokens, batch_size: int | None = None, **server_args) -> dict:
        """Greedy completions, timed, on a plain instance or one started with ``server_args``.

        A one-token warm-up request runs first. ``batch_size``: send the prompts in consecutive groups of
        that many (1 = one request at a time); None = all at once. Seconds are summed over groups.
        Returns {"outputs", "meta" (SGLang's per-request ``spec_*`` / ``completion_tokens``), "seconds",
        "tokens", "tokens_per_s", "startup_s", "batch_size"}.
        """
        mode = ("spec", json.dumps(server_args, sort_keys=True)) if server_args else ("generate",)
        self._start(mode, **server_args)
        self._call("generate", prompts=[list(prompts[0])], sampling_params=self._sampling(1, 1, 0.0, 0))
        res = {"outputs": [], "meta": [], "seconds": 0.0}
        for group in groups(prompts, batch_size):
            r = self._call("generate", prompts=[list(map(int, prompt)) for prompt in group],
                           sampling_params=self._sampling(len(group), max_new_tokens, 0.0, 0))
            res = {"outputs": res["outputs"] + r["outputs"], "meta": res["meta"] + r["meta"],
                   "seconds": res["seconds"] + r["seconds"]}
        n = sum(len(o) for o in res["outputs"])
        return {**res, "tokens": n, "tokens_per_s": n / res["seconds"], "startup_s": self.startup_s[mode[0]],
                "batch_size": batch_size}

    # ---------------------------------------------------------------- serving (eaglepipe/engines/serve.py)

    def eagle3_args(self, draft_dir: str | Path, k: int) -> dict:
        """SGLang's EAGLE-3 server arguments; raises SGLangServingUnavailable without CUDA."""
        if not torch.cuda.is_available():
            raise SGLangServingUnavailable(
                "EAGLE-3 serving with SGLang needs CUDA: its EAGLE worker builds and verifies draft trees and "
                "keeps the draft's KV with sgl_kernel GPU kernels, whose CPU builds are not published (see "
                "eaglepipe/engines/sgl_kernel_cpu_shim.py). Run serve_eval for sglang on a CUDA machine."
            )
        return serve.sglang_server_args(draft_dir, k)

    def spec_figures(self, run: dict, k: int) -> dict:
        return serve.spec_acceptance(run["meta"], k)


def serve_eagle3(
    target_dir: str | Path, draft_dir: str | Path, prompts: list[list[int]], k: int, max_new_tokens: int,
    engine: SGLangEngine | None = None, batch_sizes: tuple = (None,), **engine_opts,
) -> dict:
    """:func:`eaglepipe.engines.serve.serve_eagle3` on SGLang (``engine_opts``: :class:`SGLangEngine`'s).

    CUDA only (:meth:`SGLangEngine.eagle3_args`); raises SGLangServingUnavailable before anything starts
    on a machine without CUDA.
    """
    return serve.serve_eagle3("sglang", target_dir, draft_dir, prompts, k, max_new_tokens, engine, batch_sizes,
                              **engine_opts)


# ------------------------------------------------------------------------------------------ entry points
# ``__main__``: the worker, started by SGLangEngine with the fd of its end of the pipe.
# ``__mp_main__``: a process SGLang spawned from the worker (scheduler, detokenizer); multiprocessing re-runs
# the parent's main module under this name before it unpickles the process' target and arguments.
if __name__ in ("__main__", "__mp_main__") and os.environ.get(SHIM_ENV) == "1":
    from eaglepipe.engines import sgl_kernel_cpu_shim

    sgl_kernel_cpu_shim.install()  # before anything imports sglang in this process

if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])))
