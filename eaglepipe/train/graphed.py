"""The whole TTT training step replayed as one CUDA graph per row shape (issue 11, shape A).

Why: at small draft shapes (SmolLM2's) the step is host-bound, hundreds of small kernels launched from Python
(compiled regions, their guards, autograd, eager glue); replayed as a CUDA graph, the same kernels start from one
call. Inductor's own graphs (``compile_draft(mode="reduce-overhead")``) cover only the compiled layer.

What the graph holds: :func:`eaglepipe.train.ttt.ttt_unroll_fast` given :func:`eaglepipe.train.ttt.static_rows`
(no shape that depends on the data, nothing read back from the device), its backward, and whatever the caller's
step function does around it (the soft targets, at every position: ``need`` would read back; gradient clipping, a
capturable optimizer's step). What runs eagerly before each replay: ``static_rows`` (it reads the masks back) and
the copies into the graph's input buffers. The pattern is PyTorch's whole-network capture (``torch.cuda.graphs``
documentation: warm-up on a side stream, grads set to None before the capture so the backward writes them,
``capturable=True`` optimizers).

Capture mode: ``thread_local`` (:data:`CAPTURE_ERROR_MODE`). train_drafter's feature worker thread
(eaglepipe/train/stream.py) keeps making CUDA calls while the step thread captures: it pins host batches
(``cudaHostAlloc`` when the pinned cache has no free block) and, online, runs the target's forward on a stream of
its own (``cudaMalloc`` when the caching allocator grows). In CUDA's default ``global`` mode any thread's
potentially unsafe call invalidates every capture in progress (cudaErrorStreamCaptureInvalidated; CUDA Runtime
API, cudaStreamCaptureMode); ``thread_local`` prohibits them in the capturing thread only, which makes none. The
worker's memory never lands in the graph's pool: during a capture PyTorch's caching allocator routes to the
private pool only allocations made on a stream that is capturing this graph (``beginAllocateToPool``'s filter in
c10/cuda/CUDACachingAllocator, set by at::cuda::CUDAGraph::capture_begin), the worker's streams are not, pinned
host memory comes from a separate allocator, and the worker's batches are copied into the graph's input buffers
by the step thread outside the capture.

Tests: the static step on the CPU (tests/test_ttt.py), the capture where CUDA runs (tests/test_graphed.py),
train_drafter graphed with its worker thread busy, offline and online, where CUDA runs (tests/test_train_graph.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from eaglepipe.train.ttt import Batch, TTTResult

CAPTURE_ERROR_MODE = "thread_local"  # other threads' CUDA calls leave a capture valid (module docstring)


def _tensors(x) -> list[torch.Tensor]:
    """The tensors of a dataclass (Batch, TTTResult), fields in order, None left out."""
    return [v for f in dataclasses.fields(x) if isinstance(v := getattr(x, f.name), torch.Tensor)]


def _same_layout(a, b) -> bool:
    return [(t.shape, t.dtype, t.device) for t in _tensors(a)] == [(t.shape, t.dtype, t.device) for t in _tensors(b)]


class GraphedStep:
    """``step_fn(batch, rows) -> TTTResult`` (soft targets, forward with ``rows``, backward, then e.g. clipping and
    a ``capturable=True`` optimizer's step; no grad zeroing) replayed as a CUDA graph, one per row shape.

    A call copies ``batch`` (:class:`Batch`, one padded row (1, T), T fixed for the run) and ``rows``
    (:func:`eaglepipe.train.ttt.static_rows`: their lengths pick the graph) into the graph's buffers and replays it:
    one training step. The first call at a new row shape first runs ``warmup`` steps on
    a side stream (compiling what is compiled, creating the optimizer's state), puts ``params`` and the
    optimizer's state back as they were (state created meanwhile zeroed: Adam's and AdamW's initial values,
    torch/optim/adam.py ``_init_group``), captures, then replays once, so every call is one step.
    Returns the captured :class:`TTTResult` (loss detached), whose tensors the next call overwrites (clone what
    you keep). Graphs share one memory pool (only their temporaries and gradients live there; ``p.grad`` after a
    call is the last-captured graph's, not necessarily this call's). Values the step reads as Python numbers
    are frozen at capture: a learning-rate schedule needs the optimizer's ``lr`` as a CUDA tensor, updated in
    place. A recompile of a torch.compile'd part during the capture raises (``error_on_recompile``) instead of
    compiling inside it. Raises ValueError when ``batch`` is not on CUDA or changes shape or dtype between
    calls, RuntimeError off CUDA.
    """

    def __init__(self, step_fn: Callable[[Batch, list[torch.Tensor]], TTTResult],
                 params: list[torch.Tensor], optimizer: torch.optim.Optimizer, warmup: int = 3):
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedStep needs CUDA (CUDA graphs)")
        self.fn, self.params, self.opt, self.warmup = step_fn, params, optimizer, warmup
        self.graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, list[torch.Tensor], TTTResult]] = {}
        self.batch: Batch | None = None
        self.pool = None

    def __call__(self, batch: Batch, rows: list[torch.Tensor]) -> TTTResult:
        if self.batch is None:
            if not batch.input_ids.is_cuda:
                raise ValueError("GraphedStep: the batch must be on CUDA")
            self.batch = _clone(batch)
        elif not _same_layout(batch, self.batch):
            raise ValueError("GraphedStep: the batch must keep one shape and dtype (pad_batch)")
        else:
            _copy_into(self.batch, batch)
        key = tuple(r.numel() for r in rows)
        if key not in self.graphs:
            self.graphs[key] = self._capture([r.clone() for r in rows])
        graph, static_rows, out = self.graphs[key]
        for d, r in zip(static_rows, rows):
            d.copy_(r)
        graph.replay()
        return out

    def _capture(self, rows: list[torch.Tensor]):
        saved = _snapshot(self.params, self.opt)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.opt.zero_grad(set_to_none=True)
                self.fn(self.batch, rows)
        torch.cuda.current_stream().wait_stream(side)
        _restore(saved, self.params, self.opt)
        self.opt.zero_grad(set_to_none=True)  # the captured backward allocates the grads: written, not accumulated
        graph = torch.cuda.CUDAGraph()
        with torch._dynamo.config.patch(error_on_recompile=True), torch.cuda.graph(
                graph, pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE):
            out = self.fn(self.batch, rows)
        self.pool = self.pool or graph.pool()
        return graph, rows, dataclasses.replace(out, loss=out.loss.detach())


def _clone(x):
    return dataclasses.replace(x, **{f.name: v.clone() for f in dataclasses.fields(x)
                                     if isinstance(v := getattr(x, f.name), torch.Tensor)})


def _copy_into(dst, src) -> None:
    for d, s in zip(_tensors(dst), _tensors(src)):
        d.copy_(s, non_blocking=True)


def _snapshot(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> dict:
    """Copies of the parameters and of the optimizer state tensors that exist now."""
    return {"params": [p.detach().clone() for p in params],
            "state": {id(p): {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
                      for p, st in opt.state.items()}}


def _restore(saved: dict, params: list[torch.Tensor], opt: torch.optim.Optimizer) -> None:
    """Parameters and optimizer state back to ``saved``, in place (the graph records these addresses); state
    tensors created since are zeroed (Adam/AdamW's initial exp_avg, exp_avg_sq and step)."""
    with torch.no_grad():
        for p, v in zip(params, saved["params"]):
            p.copy_(v)
        for p, st in opt.state.items():
            old = saved["state"].get(id(p), {})
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    v.copy_(old[k]) if k in old else v.zero_()
