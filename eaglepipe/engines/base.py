"""The engine interface every capture/generation/serving backend implements.

Id spaces: :meth:`Engine.capture` takes layer ids **in the engine's own meaning** (what that engine's
draft ``config.json`` or capture option would say), never boundary indices. Translating boundary indices
h[k] to those ids is :mod:`eaglepipe.convention`'s job alone; an engine adds no +1 of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

from ..engine_table import installed_version
from ..target import TargetInfo, read_info


class Engine(ABC):
    """A target model loaded in one engine.

    Attributes:
        name: "hf" | "vllm" | "sglang" (the key of :mod:`eaglepipe.convention`'s rules).
        target_dir: the HF folder of the target.
        info: the target's :class:`eaglepipe.target.TargetInfo` (family, N, hidden, ...): passed in, else read
            from ``target_dir`` once; the engine's capture reuse asks the convention with ``info.family``.
        n_layers: N of the target (``info.n_layers``).
    """

    name: str = ""

    def __init__(self, target_dir: Path, dtype: str = "float32", info: TargetInfo | None = None, **opts):
        self.target_dir = Path(target_dir)
        self.dtype = dtype
        self.info = info if info is not None else read_info(self.target_dir, hash_weights=False)
        self.n_layers = self.info.n_layers

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
            per sequence a float32 tensor [T, len(ids), H], the captured hidden states in the order of ``ids``.
        """

    def close(self) -> None:
        """Release the engine (processes, memory). Safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve_summary(k: int, n_prompts: int, max_new_tokens: int, draft: dict, plain: dict, version: str) -> dict:
    """The engine-independent part of a served-evaluation result.

    ``draft`` / ``plain``: the timed runs with and without the draft, each a dict with ``tokens_per_s``,
    ``startup_s`` and ``outputs`` (token ids per prompt). Engines add their own τ and acceptance fields.
    """
    return {
        "k": k,
        "prompts": n_prompts,
        "max_new_tokens": max_new_tokens,
        "tokens_per_s_draft": draft["tokens_per_s"],
        "tokens_per_s_plain": plain["tokens_per_s"],
        "speedup": draft["tokens_per_s"] / plain["tokens_per_s"],
        "startup_s_draft": draft["startup_s"],
        "startup_s_plain": plain["startup_s"],
        "outputs_draft": draft["outputs"],
        "outputs_plain": plain["outputs"],
        "outputs_equal": draft["outputs"] == plain["outputs"],
        "engine_version": version,
    }


def groups(items: list, size: int | None) -> list[list]:
    """``items`` in consecutive groups of ``size`` (the last may be shorter); one group when size is None."""
    if size is None:
        return [list(items)]
    if size < 1:
        raise ValueError(f"batch size must be ≥ 1 or None, got {size}")
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


# The figures of one timed (draft, plain) pair that differ by batch size.
_PER_BATCH = ("tau", "acceptance_per_pos", "tokens_per_s_draft", "tokens_per_s_plain", "speedup", "outputs_equal")


def by_batch_size(runs: list[dict], batch_sizes: tuple) -> dict:
    """One served result from the runs at each batch size: the first run's fields at the top level, and
    ``by_batch_size`` = {"1": {tau, acceptance_per_pos, tokens_per_s_*, speedup, outputs_equal}, ...}
    ("all" for None = every prompt at once) when more than one batch size was timed. ``outputs_equal`` at
    the top is true only when every run's draft and plain outputs are equal."""
    out = dict(runs[0])
    if len(runs) > 1:
        out["by_batch_size"] = {("all" if b is None else str(b)): {f: r[f] for f in _PER_BATCH if f in r}
                                for b, r in zip(batch_sizes, runs)}
        out["outputs_equal"] = all(r["outputs_equal"] for r in runs)
    return out
