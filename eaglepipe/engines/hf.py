"""The ``hf`` engine: transformers' own model, captured with hooks on the decoder layers.

Ids are boundary indices h[k] as :mod:`eaglepipe.contract.convention` defines them (engine "hf" is its identity rule);
this module is how they are taken: k < N by a forward pre-hook on ``layers[k]`` (its input), k = N by a
forward hook on ``layers[N-1]`` (its output, before the final norm). HF's own ``output_hidden_states[N]`` is
post-norm (transformers replaces the last entry with ``last_hidden_state``), which is why it is not used.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from eaglepipe.engine_table import expert_parallel_refusal
from eaglepipe.engines.base import Engine
from eaglepipe.errors import ParamsError
from eaglepipe.target.hf_model import decoder, load_model
from eaglepipe.target.info import refuse_hf_on_quantized

log = logging.getLogger(__name__)


@contextmanager
def boundary_hooks(layers, ids: list[int]):
    """Capture h[k] for k in ``ids`` during the forward passes run inside the ``with`` block.

    Args:
        layers: the model's decoder layers (``model.model.layers``), N of them.
        ids: boundary indices in [0, N].
    Yields:
        a dict k → float32 tensor (B, T, H), filled by the next forward: a pre-hook on ``layers[k]`` takes its
        input (k < N); a hook on ``layers[N-1]`` takes its output before the final norm (k = N).
    """
    n = len(layers)
    got: dict[int, torch.Tensor] = {}

    def pre(k):
        def hook(_mod, args, kwargs):
            got[k] = (args[0] if args else kwargs["hidden_states"]).float()
        return hook

    def post(_mod, _args, output):
        got[n] = (output[0] if isinstance(output, tuple) else output).float()

    handles = [layers[k].register_forward_pre_hook(pre(k), with_kwargs=True) for k in ids if k < n]
    if n in ids:
        handles.append(layers[-1].register_forward_hook(post))
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def _batches(order: list[int], lengths: list[int], size: int, token_budget: int | None) -> list[list[int]]:
    """``order`` (indices, shortest first) cut into batches of ``size``, or of ≤ ``token_budget`` padded tokens."""
    if token_budget is None:
        return [order[b : b + size] for b in range(0, len(order), size)]
    out: list[list[int]] = [[]]
    for i in order:  # ascending, so the newest is the longest: padded tokens = count × lengths[i]
        if out[-1] and (len(out[-1]) + 1) * lengths[i] > token_budget:
            out.append([])
        out[-1].append(i)
    return [b for b in out if b]


def compile_layers(layers) -> None:
    """Regional compilation of ``layers`` (the N decoder layers, all of one class): one ``torch.compile`` of the
    layer class's ``forward`` (inductor, dynamic batch and length), bound to each layer in place of its own.

    A decoder layer is the target's unit of repetition, so the N layers share one graph (torch >= 2.5 passes a
    module's parameters as graph inputs: PyTorch's "regional compilation" recipe) and inductor fuses the eager
    model's memory-bound element-wise chains (RMSNorm's casts/pow/mean/rsqrt/mul, rotary's rotate_half,
    SiLU × up, the residual adds) that dominate a small target's forward on a GPU. What stays eager is the part
    around the layers: embeddings, rotary tables, the final norm and the boundary hooks of
    :func:`boundary_hooks`, which run in each layer's ``__call__`` around the compiled ``forward``. Compiling
    the whole base model instead (hooks traced) compiled for ~100 s and captured slower than eager on an
    H200 (benchmarks/h200/online_train.json). Same values as eager up to the
    fused kernels' rounding (tests/test_hf_engine.py).
    """
    import types

    fwd = torch.compile(type(layers[0]).forward, dynamic=True)
    for layer in layers:
        layer.forward = types.MethodType(fwd, layer)


def check_tensor_parallel(target_dir, tensor_parallel_size: int) -> None:
    """Refuse a target transformers cannot shard over ``tensor_parallel_size`` ranks. Raises ParamsError.

    ``DistributedConfig(tp_plan="auto")`` applies the config class's ``base_model_tp_plan``
    (transformers/models/<model_type>/configuration_<model_type>.py: Llama, Mistral, Qwen2/3, Gemma, Phi3,
    DeepSeek-V3, ... have one); a family without one gets an empty plan, which
    transformers/distributed/mixin.py ``maybe_distribute_model`` applies as no sharding at all (every rank holds the
    whole target). The plan shards q/k/v column-wise by head, so the attention and KV head counts must divide by T,
    and the CausalLM's ``lm_head`` column-wise with its output gathered, so the vocabulary must too
    (transformers/distributed/tensor_parallel.py ``ColwiseParallel.validate_param``).
    """
    if tensor_parallel_size == 1:
        return
    import inspect

    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(target_dir)
    where = inspect.getsourcefile(type(cfg)) or type(cfg).__module__
    where = where[where.find("transformers/"):] if "transformers/" in where else where
    if not getattr(cfg, "base_model_tp_plan", None):
        raise ParamsError(f"tensor_parallel_size {tensor_parallel_size} with the hf engine: transformers has no "
                          f"tensor-parallel plan for model_type {cfg.model_type!r} ({type(cfg).__name__}."
                          f"base_model_tp_plan is empty in {where}); use engine vllm or sglang, or "
                          "tensor_parallel_size: 1")
    sizes = {k: getattr(cfg, k, None) for k in ("num_attention_heads", "num_key_value_heads", "vocab_size")}
    bad = {k: v for k, v in sizes.items() if v is not None and v % tensor_parallel_size}
    if bad:
        raise ParamsError(f"tensor_parallel_size {tensor_parallel_size} with the hf engine: transformers' plan "
                          f"({where}) splits the attention heads and the vocabulary over the ranks, and {bad} do not "
                          f"divide by {tensor_parallel_size}; choose a tensor_parallel_size that divides them, or "
                          "engine vllm or sglang")


def load_tensor_parallel(target_dir, dtype: str, tensor_parallel_size: int):
    """This rank's shard of the target: ``AutoModelForCausalLM`` with ``DistributedConfig(tp_size=T,
    tp_plan="auto")`` (transformers/distributed/configuration_utils.py), under torchrun with WORLD_SIZE == T. It
    takes the default process group when one exists (eaglepipe/data/distributed_extract.py ``process_group``), and
    places the rank on cuda:LOCAL_RANK, or the CPU (transformers/distributed/utils.py
    ``initialize_distributed_mesh``). The decoder layers' outputs are whole (rowwise layers all-reduce), so the
    boundary hooks see the same (B, T, H) tensors as one device, up to the reductions' rounding.
    Raises ParamsError outside such a world, or for a target :func:`check_tensor_parallel` refuses."""
    import os

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DistributedConfig

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world != tensor_parallel_size:
        raise ParamsError(f"the hf engine at tensor_parallel_size {tensor_parallel_size} runs as that many torchrun "
                          f"ranks (the extract stage launches them), but this world has {world}")
    check_tensor_parallel(target_dir, tensor_parallel_size)
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dtype), distributed_config=(
        DistributedConfig(tp_size=tensor_parallel_size, tp_plan="auto")))


class HFEngine(Engine):
    """transformers ``AutoModelForCausalLM`` on CPU or CUDA (chosen automatically); at ``tensor_parallel_size`` T > 1
    one torchrun rank of T holding its shard of the target (:func:`load_tensor_parallel`): every rank must make the
    same calls with the same inputs (lockstep), and each gets the whole result."""

    name = "hf"

    def __init__(self, target_dir, dtype: str = "float32", device: str | None = None, batch_size: int = 16,
                 info=None, quantization: str | None = None, compile: bool = False, tensor_parallel_size: int = 1,
                 expert_parallel: bool = False, **_):
        super().__init__(target_dir, dtype, info)
        if tensor_parallel_size > 1 and compile:  # params refuse it first (online capture is one device's)
            raise ParamsError("the hf engine compiles its layers on one device only: tensor_parallel_size "
                              f"{tensor_parallel_size} with compile")
        if expert_parallel:  # params refuse it first (eaglepipe/params.py); a direct caller here
            raise ParamsError(f"expert_parallel: {expert_parallel_refusal('hf', True)}; it needs engine vllm or sglang")
        if quantization is not None:  # params refuse it first (eaglepipe/target/quantization.py); a direct caller here
            raise ParamsError(f"the hf engine (transformers) serves no quantized target in eaglepipe: "
                              f"quantization {quantization!r} needs engine vllm or sglang")
        refuse_hf_on_quantized(self.target_dir, ["an hf engine started on it"])
        from transformers import AutoTokenizer

        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(self.target_dir)
        if tensor_parallel_size > 1:  # placed by transformers: cuda:LOCAL_RANK or the CPU
            self.model = load_tensor_parallel(self.target_dir, dtype, tensor_parallel_size).eval()
            self.device = str(self.model.device)
        else:
            self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            self.model = load_model(self.target_dir, getattr(torch, dtype))
            self.model.to(self.device).eval()
        self._base = decoder(self.model)  # model.model, or a wrapper's language model (eaglepipe/target/hf_model.py)
        self.layers = self._base.layers  # N of them (self.n_layers, from the target's TargetInfo)
        # compile: the decoder layers through one torch.compile (compile_layers); the boundary hooks stay
        # eager. benchmarks/online_train.py times it against eager (capture_only rows)
        self.compiled = compile
        if compile:
            compile_layers(self.layers)
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen is not None and gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])

    @torch.inference_mode()
    def capture(self, sequences: list[list[int]], ids: list[int], on_device: bool = False,
                token_budget: int | None = None) -> list[torch.Tensor]:
        """h[k] for k in ``ids`` (boundary indices), per sequence float32 (T, len(ids), H).

        Sequences are batched right-padded, shortest first, and run with no attention mask: causal attention
        already keeps a real token from the padding after it, and without a mask transformers' SDPA path runs
        ``is_causal`` (the flash kernel on CUDA) instead of a materialized (B, 1, T, T) mask. A batch holds
        ``batch_size`` sequences, or with ``token_budget`` as many as fit in that many padded tokens (batch × its
        longest; a longer sequence runs alone). Runs the base model only (no lm_head). Raises ValueError for ids
        outside [0, N].
        on_device: keep the results on the model's device (online training, eaglepipe/train/online.py), not the CPU;
        they are inference tensors either way (copy or cat them before autograd saves them).
        """
        bad = [k for k in ids if not 0 <= k <= self.n_layers]
        if bad:
            raise ValueError(f"hf capture: ids {bad} outside [0, {self.n_layers}]")
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # similar lengths share a batch
        out: list[torch.Tensor | None] = [None] * len(sequences)
        for idx in _batches(order, [len(s) for s in sequences], self.batch_size, token_budget):
            for i, t in zip(idx, self._capture_batch([sequences[i] for i in idx], ids, on_device)):
                out[i] = t
        return out

    def _capture_batch(self, seqs: list[list[int]], ids: list[int], on_device: bool = False) -> list[torch.Tensor]:
        T = max(len(s) for s in seqs)
        rows = len(seqs) + (len(seqs) == 1 and self.compiled)  # compiled: B ≥ 2 (dynamo specializes B = 1)
        input_ids = torch.zeros(rows, T, dtype=torch.long)  # (B, T), right-padded with id 0
        for i, s in enumerate(seqs):
            input_ids[i, : len(s)] = torch.tensor(s)
        with boundary_hooks(self.layers, ids) as got:  # positions 0..T-1 per row, causal, no mask (docstring)
            self._base(input_ids=input_ids.to(self.device), use_cache=False)
        stacked = torch.stack([got[k] for k in ids], dim=2)  # (B, T, len(ids), H)
        stacked = stacked if on_device else stacked.cpu()
        return [stacked[i, : len(s)].contiguous() for i, s in enumerate(seqs)]

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens, temperature=0.0, seed=0):
        """Batched ``model.generate`` with left padding; greedy when temperature is 0, else seeded sampling."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else next(iter(self.eos_ids))
        torch.manual_seed(seed)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # less padding per batch
        out: list[list[int] | None] = [None] * len(prompts)
        for b in range(0, len(order), self.batch_size):
            idx = order[b : b + self.batch_size]
            batch = [prompts[i] for i in idx]
            T = max(len(prompt) for prompt in batch)
            input_ids = torch.full((len(batch), T), pad, dtype=torch.long)  # (B, T), left-padded
            mask = torch.zeros(len(batch), T, dtype=torch.long)
            for row, prompt in enumerate(batch):
                input_ids[row, T - len(prompt) :] = torch.tensor(prompt)
                mask[row, T - len(prompt) :] = 1
            kw = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {
                "do_sample": False}
            gen = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=list(self.eos_ids), **kw,
            )[:, T:].cpu()
            for i, row in zip(idx, gen.tolist()):
                cut = next((j + 1 for j, t in enumerate(row) if t in self.eos_ids), len(row))
                out[i] = row[:cut]
        return out
