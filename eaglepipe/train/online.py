"""Online training's features: the frozen target computes, for the samples of each packed row, what extract
would have stored for them (``extract.store: tokens``, see eaglepipe/data/features.py).

It is extract's own capture path, through the engine that extracted the store (the manifest's ``engine``):
- ``hf``: :class:`eaglepipe.engines.hf.HFEngine` on the training device (its boundary hooks on the decoder
  layers, its length-sorted right-padded batches, in ``extract.engine_dtype``);
- ``vllm`` / ``sglang``: the serving engine in its own processes, with its own parallelism (the manifest's
  ``tensor_parallel_size`` and ``expert_parallel``): the trainer holds no copy of the target, and the capture is the one
  validate_offsets gates. The hand-over is bounded: one row's states at a time (vLLM's connector file of a
  request is read and removed at once; SGLang returns them through its worker's pipe), and the data thread's
  prefetch queue (:class:`eaglepipe.train.stream.BatchStream`) blocks the capture when training falls behind.
Then the manifest's ``capture_ids`` (``layers + [N]`` in that engine's meaning) and extract's cast to the store
dtype (:func:`eaglepipe.data.features.store_capture`). The teacher's input h[N] (→ final norm → lm_head, the soft
targets) is the last of those ids, so it is computed online too. A sample's fp32 states can differ in the
last bits when it shares a forward with other samples than in extract (other padding, other matmul shapes);
after the cast to ``extract.dtype`` that is at most one rounding step of that dtype on a few elements
(tests/test_online.py measures it and the loss curves it gives).

Memory on the training device with the hf engine, beyond offline training (which instead reads ``(L+1)·H·bytes``
a token from the shards, through host memory):
  - the target's weights in engine_dtype (its lm_head included, unused): SmolLM2-135M fp32 0.54 GB; an 8B
    target in bf16 ~16 GB;
  - one no-grad forward over a row (≤ 2 · ``train.batch_tokens`` padded tokens, sequences padded to the longest of their
    batch): the activations of one decoder layer at a time plus the hooked states, i.e. about
    ``batch_tokens · ((L+1)·H · 4 + (H + 2·intermediate + n_heads·T_max) · bytes)``; at SmolLM2 shapes and
    2,048 tokens that is ~20 MB of captured fp32 states (4 × 576 × 4 bytes a token) and a few tens of MB of
    activations; at 8B (H 4096, intermediate 14336), ~134 MB of states and ~0.3 GB of activations.
Host memory holds no feature shard: the data thread reads token ids and masks only.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eaglepipe.data.features import store_capture
from eaglepipe.errors import FeatureStoreError

log = logging.getLogger(__name__)


class OnlineCapture:
    """``capture(input_ids_list)`` → per sample (aux (T, L, H), last (T, H)) in the store dtype, on ``device``.

    token_budget: padded tokens per target forward (:meth:`HFEngine.capture`); None: 16 samples a forward.
    compile: the target's decoder layers through torch.compile (``HFEngine(compile=True)``,
    :func:`eaglepipe.engines.hf.compile_layers`); train_drafter asks for it with ``train.fast`` on CUDA, and
    benchmarks/online_train.py's capture_only rows time it against eager.

    Built from a tokens store's manifest (store, dtype, engine_dtype, capture_ids, target shape); raises
    FeatureStoreError for a features store or a target whose shape differs from the manifest's.
    """

    def __init__(self, target_dir: str | Path, manifest: dict, device: torch.device, token_budget: int | None = None,
                 compile: bool = False):
        if manifest.get("store") != "tokens":
            raise FeatureStoreError(
                f"online capture needs a 'tokens' store (extract.store: tokens); this one is "
                f"{manifest.get('store', 'features')!r}: its features are read from the shards")
        self.ids = list(manifest["capture_ids"])
        self.dtype = manifest["dtype"]
        self.token_budget = token_budget  # padded tokens a forward (train: 2 × batch_tokens, one forward a row)
        self.device = device
        self.engine_name = manifest.get("engine", "hf")
        self.compiled = compile and self.engine_name == "hf"  # BatchStream then captures in its consuming thread
        self.engine = _capture_engine(target_dir, manifest, device, self.compiled)
        want = manifest["target"]
        got = self.engine.info
        if (got.n_layers, got.hidden_size) != (want["n_layers"], want["hidden_size"]):
            raise FeatureStoreError(
                f"target {target_dir}: N {got.n_layers}, hidden {got.hidden_size}, but the tokens store was extracted "
                f"from N {want['n_layers']}, hidden {want['hidden_size']}; re-run extract")
        log.info("online capture: target %s in %s on %s in %s%s, ids %s, cast to %s", target_dir, self.engine_name,
                 device if self.engine_name == "hf" else "its own processes", manifest["engine_dtype"],
                 ", compiled" if self.compiled else "", self.ids, self.dtype)

    def __call__(self, input_ids: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        seqs = [t.tolist() for t in input_ids]
        if self.engine_name == "hf":
            caps = self.engine.capture(seqs, self.ids, on_device=True, token_budget=self.token_budget)
        else:  # float32 on the host, from the engine's processes
            caps = [h.to(self.device) for h in self.engine.capture(seqs, self.ids)]
        return [store_capture(h, self.dtype) for h in caps]  # (T, L+1, H) each before the split

    def close(self) -> None:
        self.engine.close()


def _capture_engine(target_dir: str | Path, manifest: dict, device: torch.device, compile: bool):
    """The manifest's extract engine on the target: hf on ``device``; vllm / sglang started as extract started
    them (dtype, quantization, tensor_parallel_size and expert_parallel from the manifest)."""
    from eaglepipe.engines import get_engine

    name = manifest.get("engine", "hf")
    if name == "hf":
        return get_engine("hf", target_dir, dtype=manifest["engine_dtype"], device=str(device), compile=compile)
    return get_engine(name, target_dir, dtype=manifest["engine_dtype"], quantization=manifest.get("quantization"),
                      tensor_parallel_size=manifest.get("tensor_parallel_size", 1),
                      expert_parallel=manifest.get("expert_parallel", False))
