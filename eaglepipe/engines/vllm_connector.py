"""A CPU-safe hidden-states connector for vLLM's ``extract_hidden_states`` speculative method.

vLLM 0.32's stock ``ExampleHiddenStatesConnector`` copies each finished request's hidden states out of the
cache-only KV layer on a dedicated CUDA stream into pinned host memory, and tracks completion with CUDA
events. None of that exists on CPU (``pin_memory=True requires a CUDA…``, ``torch.cuda.Stream``,
``torch.cuda.Event``). This subclass replaces only ``_submit_async_write``: it gathers the request's slots
from the cache and writes the file synchronously (a plain CPU copy, nothing to overlap), and records a
completed-event stand-in so the stock ``get_finished`` reports the request as sent. File format, paths,
``.lock`` files and scheduler-side behaviour stay the stock connector's, so ``load_hidden_states`` reads it.

vLLM loads the class by name in its spawned worker processes, through
``kv_transfer_config={"kv_connector": "CPUHiddenStatesConnector",
"kv_connector_module_path": "eaglepipe.engines.vllm_connector", ...}``; keep this module import-light.

Written file (safetensors, one per request): ``hidden_states`` (T, L, H) in the model dtype, L = the
``eagle_aux_hidden_state_layer_ids`` of the extract config in ascending order; ``token_ids`` int64 (T,).
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event the stock ``get_finished`` polls: the copy is already complete."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` without CUDA streams, events or pinned memory."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()  # (blocks * bs,)
        n = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots, n).clone()  # (T, L, H)
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers blocked in load_hidden_states proceed
        self._req_copy_events[pending.req_id] = _Done()
