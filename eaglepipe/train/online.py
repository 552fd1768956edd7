"""Online training's features: the frozen target, on the training device, computes for the samples of each
packed row what extract would have stored for them (``extract.store: tokens``, see eaglepipe/data/features.py).

It is extract's own capture path: :class:`eaglepipe.engines.hf.HFEngine` (its boundary hooks on the decoder
layers, its length-sorted right-padded batches, in ``extract.engine_dtype``) with the manifest's
``capture_ids`` (``layers + [N]`` in hf's meaning, the identity), then extract's cast to the store dtype
(:func:`eaglepipe.data.features.store_capture`). The teacher's input h[N] (→ final norm → lm_head, the soft
targets) is the last of those ids, so it is computed online too. A sample's fp32 states can differ in the
last bits when it shares a forward with other samples than in extract (other padding, other matmul shapes);
after the cast to ``extract.dtype`` that is at most one rounding step of that dtype on a few elements
(tests/test_online.py measures it and the loss curves it gives).

Memory on the training device, beyond offline training (which instead reads ``(L+1)·H·bytes`` a token from
the shards, through host memory):
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
        from eaglepipe.engines.hf import HFEngine

        if manifest.get("store") != "tokens":
            raise FeatureStoreError(
                f"online capture needs a 'tokens' store (extract.store: tokens); this one is "
                f"{manifest.get('store', 'features')!r}: its features are read from the shards")
        self.ids = list(manifest["capture_ids"])
        self.dtype = manifest["dtype"]
        self.token_budget = token_budget  # padded tokens a forward (train: 2 × batch_tokens, one forward a row)
        self.compiled = compile  # BatchStream then captures in its consuming thread (dynamo is not thread-safe)
        self.engine = HFEngine(target_dir, dtype=manifest["engine_dtype"], device=str(device),
                               compile=compile)
        want = manifest["target"]
        got = self.engine.info
        if (got.n_layers, got.hidden_size) != (want["n_layers"], want["hidden_size"]):
            raise FeatureStoreError(
                f"target {target_dir}: N {got.n_layers}, hidden {got.hidden_size}, but the tokens store was extracted "
                f"from N {want['n_layers']}, hidden {want['hidden_size']}; re-run extract")
        log.info("online capture: target %s on %s in %s%s, ids %s, cast to %s", target_dir, device,
                 manifest["engine_dtype"], ", compiled" if compile else "", self.ids, self.dtype)

    def __call__(self, input_ids: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        caps = self.engine.capture([t.tolist() for t in input_ids], self.ids, on_device=True,
                                   token_budget=self.token_budget)  # (T, L+1, H) each
        return [store_capture(h, self.dtype) for h in caps]

    def close(self) -> None:
        self.engine.close()
