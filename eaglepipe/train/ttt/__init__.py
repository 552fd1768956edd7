"""Training-time test (TTT): the draft unrolled over a packed batch, its loss and accuracy.

Modules in reading order (each imports only those before it):

- ``batch``: :class:`Batch` (what the unroll reads) and :class:`TTTResult` (what it returns).
- ``masks``: which positions step j counts (:func:`counted_trained`) and which keys a query sees
  (:func:`ttt_mask` as a table, the step-0 block, flex_attention's mask_mod and block mask).
- ``rows``: the positions each step computes (:func:`chain_rows`) and the padding to few lengths
  (:func:`pad_batch`, :func:`flex_rows`, :func:`static_rows`).
- ``attention``: :class:`TTTAttention` (plain) and :class:`FlexTTTAttention` (flex_attention on CUDA),
  :func:`compile_draft`.
- ``loss``: the soft cross-entropy (:func:`soft_ce`, fused with its gradient), accuracy and :func:`tau_sim`.
- ``unroll``: the EAGLE shift, :func:`ttt_unroll` (the reference) and :func:`ttt_unroll_fast`, :class:`TTTUnroll`.

The names below are re-exported for callers. A test that monkeypatches a function patches it in the module that
calls it (``unroll.uses_flex``, ``attention.flex_attention_fn``): patching the name here changes nothing.
"""

from eaglepipe.train.ttt.attention import FlexTTTAttention, TTTAttention, compile_draft, flex_attention_fn, uses_flex
from eaglepipe.train.ttt.batch import Batch, TTTResult
from eaglepipe.train.ttt.loss import soft_ce, tau_sim
from eaglepipe.train.ttt.masks import BLOCK, counted_trained, ttt_mask
from eaglepipe.train.ttt.rows import (
    PAD_DOC,
    bucket_length,
    chain_rows,
    flex_rows,
    pad_batch,
    padded_length,
    static_rows,
)
from eaglepipe.train.ttt.unroll import TTTUnroll, align_step, ttt_unroll, ttt_unroll_fast

__all__ = [
    "BLOCK", "PAD_DOC", "Batch", "FlexTTTAttention", "TTTAttention", "TTTResult", "TTTUnroll", "align_step",
    "bucket_length", "chain_rows", "compile_draft", "counted_trained", "flex_attention_fn", "flex_rows",
    "pad_batch", "padded_length", "soft_ce", "static_rows", "tau_sim", "ttt_mask", "ttt_unroll", "ttt_unroll_fast",
    "uses_flex",
]
