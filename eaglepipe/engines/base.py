"""The engine interface every capture/generation/serving backend implements.

Id spaces: :meth:`Engine.capture` takes layer ids **in the engine's own meaning** (what that engine's
draft ``config.json`` or capture option would say), never boundary indices. Translating boundary indices
h[k] to those ids is :mod:`eaglepipe.contract.convention`'s job alone; an engine adds no +1 of its own.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from eaglepipe.engine_table import installed_version
from eaglepipe.errors import ParamsError, ServingUnavailable
from eaglepipe.target.info import TargetInfo, read_info


def _cpu_list(cpus: list[int]) -> str:
    """Cores as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` wants one group of them ("0-1" or "0,2")."""
    if len(cpus) > 1 and cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def cpu_groups(ranks: int) -> str:
    """The cores this process may run on, split into ``ranks`` groups joined by "|" ("0|1" for 2 ranks on 2
    cores): vLLM's and SGLang's CPU backends bind tensor-parallel rank i to group i and want one group per
    rank (``VLLM_CPU_OMP_THREADS_BIND``: vllm/utils/ompmultiprocessing.py; ``SGLANG_CPU_OMP_THREADS_BIND``:
    sglang/srt/utils/numa_utils.py, whose worker dies without it at TP > 1 on one node). Raises ParamsError when
    there are fewer cores than ranks."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        raise ParamsError(f"tensor_parallel_size {ranks} on a CPU needs a core per rank; this process may use "
                          f"{len(cpus)} ({cpus})")
    size = len(cpus) // ranks
    return "|".join(_cpu_list(cpus[i * size:(i + 1) * size]) for i in range(ranks))


class Engine(ABC):
    """A target model loaded in one engine.

    Attributes:
        name: "hf" | "vllm" | "sglang" (the key of :mod:`eaglepipe.contract.convention`'s rules).
        target_dir: the HF folder of the target.
        info: the target's :class:`eaglepipe.target.info.TargetInfo` (family, N, hidden, ...): passed in, else read
            from ``target_dir`` once; the engine's capture reuse asks the convention with ``info.family``.
        n_layers: N of the target (``info.n_layers``).
    """

    name: str = ""

    def __init__(self, target_dir: Path, dtype: str = "float32", info: TargetInfo | None = None, **opts):
        self.target_dir = Path(target_dir)
        self.dtype = dtype
        self.info = info if info is not None else read_info(self.target_dir, hash_weights=False)
        self.n_layers = self.info.n_layers
        self.quantization: str | None = None  # the engine's own method the target is served with (subclasses)

    @property
    def version(self) -> str:
        """The engine's package version (recorded in manifests and metrics; eaglepipe/engine_table.py)."""
        return installed_version(self.name)

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> list[list[int]]:
        """Complete each prompt (token ids, chat template already applied).

        Returns one list of generated token ids per prompt, without the prompt, ending at (and including)
        the first end-of-turn/EOS token if one was generated. temperature 0 = greedy.
        """

    @abstractmethod
    def capture(self, sequences: list[list[int]], ids: list[int]) -> list[torch.Tensor]:
        """Run the target over each full sequence (prefill only) and return what the engine captures.

        Args:
            sequences: token ids per sequence.
            ids: layer ids in THIS engine's meaning (ascending as the engine orders them).
        Returns:
            per sequence a float32 tensor (T, len(ids), H), the captured hidden states in the order of ``ids``.
        """

    # ------------------------------- serving (measured by eaglepipe/engines/serve.py's measure(engine, ...))

    def eagle3_args(self, draft_dir: str | Path, k: int) -> dict:
        """Keyword arguments of :meth:`generate_timed` that start an instance drafting with ``draft_dir``.

        Raises ServingUnavailable (this base: an engine that serves no drafts, e.g. hf)."""
        raise ServingUnavailable(f"engine {self.name!r} serves no EAGLE-3 draft (the reference decoder measures hf)")

    def generate_timed(self, prompts: list[list[int]], max_new_tokens: int, batch_size: int | None = None,
                       **instance) -> dict:
        """Greedy completions, timed (``instance``: :meth:`eagle3_args`, or none for the plain target).

        Returns at least {"outputs", "seconds", "tokens", "tokens_per_s", "startup_s", "batch_size"} plus what
        :meth:`spec_figures` reads."""
        raise ServingUnavailable(f"engine {self.name!r} has no timed serving")

    def spec_figures(self, run: dict, k: int) -> dict:
        """τ, acceptance per position and the engine's own counters of one timed drafted run."""
        raise ServingUnavailable(f"engine {self.name!r} has no speculative counters")

    def start_generation(self) -> None:
        """Start now what :meth:`generate` needs, instead of at its first call (extract's workers start their
        engines one at a time, eaglepipe/data/extract.py). Default: nothing to start (an engine loaded at
        construction)."""

    def start_capture(self, ids: list[int]) -> None:
        """Start now what :meth:`capture` over ``ids`` (the engine's meaning) needs; as :meth:`start_generation`."""

    def close(self) -> None:
        """Release the engine (processes, memory). Safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

