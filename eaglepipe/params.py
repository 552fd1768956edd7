"""params.yaml → validated, typed params. Unknown keys, bad bounds and bad layer lists are refused up front.

``load_params()`` raises :class:`ParamsError` with one message per problem naming the key, the bad value
and what is allowed. Stage scripts call it first, before any work, and exit non-zero on failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from eaglepipe.contract.boundaries import list_problem
from eaglepipe.contract.variants import KEYS as NORM_KEYS
from eaglepipe.contract.variants import combination_problem
from eaglepipe.engine_table import NAMES as ENGINE_NAMES
from eaglepipe.errors import ParamsError

Engine = Literal[ENGINE_NAMES]  # "hf" | "vllm" | "sglang" (eaglepipe/engine_table.py)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TargetParams(_Strict):
    """Stage `target`: where the target model comes from, and the dtype its HF folder is written in."""

    source: str = Field("smollm2-135m-instruct", description="a local HF folder, a .gguf file, or the bundled "
                        "name 'smollm2-135m-instruct'; a DVC dependency, so its contents are hashed")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="dtype of the weights written "
                                                             "to data/target/")
    chat_template: str = Field("", description="a Jinja chat template for a tokenizer shipped without one (or to "
                               "replace its own), written to data/target/chat_template.jinja; '' keeps the tokenizer's")
    unquantized: str = Field("", description="the float release of a pre-quantized target.source (a local HF folder): "
                             "validate_offsets reports the served checkpoint's numerics gap against it; '' = none")


class PromptsParams(_Strict):
    """Stage `prompts`: which conversations are read, how they are cut, and the train/eval split."""

    source: str = Field("sharegpt", description="'sharegpt' (the bundled file) or a path: a .json ShareGPT list or "
                        "a .jsonl of OpenAI 'messages' records, either of them gzipped or not (.json.gz, "
                        ".jsonl.gz); a DVC dependency")
    max_records: int = Field(4000, ge=0, description="records read before filtering (0 = all)")
    max_turns: int = Field(1, ge=1, description="user→assistant exchanges kept per conversation")
    max_chars: int = Field(1200, ge=16, description="messages are cut to this many characters")
    drop_leading_assistant: bool = Field(False, description="drop assistant messages that open a conversation "
                                         "(FastChat's ShareGPT rule) instead of skipping it as role_order")
    train: int = Field(128, ge=1, description="conversations kept for training")
    eval: int = Field(16, ge=0, description="held-out conversations added to the eval prompts")
    mtbench: bool = Field(True, description="add MT-bench's 80 first turns to eval (measured first)")
    humaneval: int = Field(0, ge=0, le=164, description="HumanEval problems added to eval (a second benchmark)")
    synthetic: int = Field(0, ge=0, description="self-written training conversations added to train (Magpie, Xu et "
                           "al. 2024, arXiv:2406.08464): extract has the target write the user turn from its chat "
                           "template's user header (extract.synthetic_temperature), then answer it; needs "
                           "extract.regenerate")
    synthetic_topics: list[str] = Field(
        default_factory=list, description="system turns that steer the user turns the target writes for "
        "prompts.synthetic (Magpie's system-prompt control, arXiv:2406.08464 §2.2): record i is written under topic "
        "i mod len, then answered and trained without it (the template's default system turn, as served); [] = "
        "none")
    seed: int = Field(0, description="seed of the train/eval split")


class ExtractParams(_Strict):
    """Stage `extract`: regeneration, tokenization and the capture of the aux states h[k] and h[N]."""

    engine: Engine = Field("hf", description="engine that captures the training features: hf | vllm | sglang")
    regenerate: bool = Field(True, description="replace the assistant turns by the target's own answers")
    regenerate_engine: Engine | None = Field(
        None, description="engine that writes the regenerated assistant turns (null: extract.engine). Only text "
        "crosses over: the features still come from extract.engine, e.g. vllm regenerating at GPU speed for a "
        "tokens store whose features the hf capture computes online")
    max_new_tokens: int = Field(64, ge=1, description="tokens generated per regenerated assistant turn")
    thinking: Literal["template", "on", "off", "mix"] = Field(
        "template", description="a reasoning target's thinking mode in regeneration and templating, passed as its "
        "chat template's switch (enable_thinking: Qwen3; thinking: DeepSeek-V3.1, Kimi-K2.5; gpt-oss's harmony "
        "format always reasons: on or template; eaglepipe/target/reasoning.py): template = no switch passed (the "
        "template's default); on / off; mix = on for a seeded thinking_share of the conversations. The target stage "
        "refuses a template without a switch")
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="a harmony (gpt-oss) target's reasoning_effort, passed to its chat template in every mode "
        "(null: the template's default, medium); the target stage refuses it for other templates")
    thinking_share: float = Field(0.5, ge=0.0, le=1.0, description="thinking: mix: share of the conversations "
                                  "regenerated with thinking on (drawn per conversation from extract.seed and its id)")
    max_thinking_tokens: int = Field(1024, ge=1, description="tokens generated per assistant turn with thinking on "
                                     "(reasoning and answer; a trace still open there is kept and counted as cut)")
    train_reasoning: bool = Field(True, description="the loss mask covers the reasoning the target writes (false: "
                                  "its answers only)")
    temperature: float = Field(0.0, ge=0.0, description="regeneration temperature; 0 = greedy (recorded in the "
                               "manifest)")
    synthetic_temperature: float = Field(1.0, gt=0.0, description="sampling temperature of the user turns the "
                                         "target writes for prompts.synthetic conversations (Magpie's 1.0)")
    seed: int = Field(0, description="sampling seed of regeneration and of self-written user turns (request i "
                      "gets seed + i)")
    batch_size: int = Field(16, ge=1, description="sequences per generate / capture batch")
    max_length: int = Field(512, ge=8, description="tokens per sample after templating (longer samples are cut)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", description="dtype of the stored "
                                                             "features")
    # bf16 where the engine has no fp32 kernels (vLLM's MLA backends on CUDA: vllm/v1/attention/backends/mla/*.py
    # ``supported_dtypes``) or to match a bf16 serving engine.
    engine_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the capturing engine computes in (bfloat16 for MLA targets on vLLM/CUDA, or "
        "to match a bf16 serving engine)")
    shard_size: int = Field(64, ge=1, description="samples per feature shard")
    workers: int = Field(1, ge=1, description="processes extracting shards side by side, each with its own "
                         "engine instances (shard i goes to worker i mod workers); the shards are the same bytes "
                         "for any count. For a GPU whose small target decodes at the speed of vLLM's per-step CPU "
                         "work; 1 = in the stage's own process")
    nproc_per_node: int = Field(1, ge=1, description="engine replicas extracting side by side on this host, each "
                                "on its own tensor_parallel_size GPUs (so nproc_per_node × tensor_parallel_size ≤ "
                                "the host's GPUs; on a CPU, each on its share of the cores); > 1 re-launches the "
                                "stage under `torchrun --standalone` (shard i goes to rank i mod ranks; the same "
                                "shard bytes for any count). Several hosts: docs/cluster.md. The hf engine at "
                                "tensor_parallel_size > 1 is one replica of that many ranks: 1 here")
    store: Literal["features", "tokens"] = Field(
        "features", description="features: shards hold h[k] and h[N] per token (offline training); tokens: token "
        "ids, loss masks and the regenerated text, plus features for the validate.samples samples the offset gate "
        "reads; train_drafter then computes the features online with extract.engine's capture: hf on the training "
        "device, or vllm / sglang in their own processes at tensor_parallel_size (the trainer holds no target)")
    quantization: str | None = Field(None, description="the engine's own quantization method (e.g. 'fp8' on "
                                     "vllm/sglang; eaglepipe/target/quantization.py): extract with the quantized "
                                     "serving engine itself, so the features carry its numerics")

    @field_validator("nproc_per_node")
    @classmethod
    def _replicas_or_workers(cls, v: int, info: ValidationInfo) -> int:
        workers = info.data.get("workers", 1)
        if v > 1 and workers > 1:
            raise ValueError(f"with extract.workers = {workers}: the torchrun ranks are the replicas and do not "
                             "spawn workers; set one of them to 1")
        return v



class ValidateParams(_Strict):
    """Stage `validate_offsets`: the gate that re-captures stored samples through the serving engine."""

    samples: int = Field(4, ge=1, description="stored samples re-captured through the serving engine")
    search: int = Field(2, ge=0, le=8, description="neighbouring boundaries searched on each side of the exported "
                        "id")
    min_cosine: float = Field(0.999, gt=0.0, le=1.0, description="below this mean cosine at offset 0 the gate "
                              "fails (a numerics gap)")
    min_match_cosine: float = Field(0.9, gt=0.0, le=1.0, description="a stored layer whose best cosine over "
                                    "the boundaries within ±search is below this matches no capture at all: the "
                                    "gate names no offset then (verdict 'mismatch')")
    max_rel_l2: float = Field(0.05, gt=0.0, description="above this relative L2 at offset 0 the gate fails "
                              "(a numerics gap, like a cosine below min_cosine)")
    quantization: str | None = Field(None, description="validate against the serving engine quantized this way "
                                     "(e.g. 'fp8'; eaglepipe/target/quantization.py)")
    engine_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the serving engine computes in (vLLM's fp8 needs bfloat16 or float16)")
    reference: bool = Field(True, description="with quantization: also capture through the unquantized engine, "
                            "so the gap is reported against the engine's own unquantized numerics")


class TrainParams(_Strict):
    """Stage `train_drafter`: the EAGLE-3 draft, its training-time-test unroll and the optimizer."""

    draft_vocab_size: int = Field(8192, ge=2, description="draft vocabulary: the most frequent predicted target "
                                  "tokens (d2t offsets / t2d mask map it to the target's)")
    draft_intermediate_size: int = Field(0, ge=0, description="width of the draft's MLP (its config.json "
                                         "intermediate_size); 0 = the target's. Both engines build the draft "
                                         "layer's MLP from the draft's own config (vLLM llama_eagle3.py / SGLang "
                                         "llama_eagle3.py via llama.py's LlamaMLP), so any width serves")
    draft_norms: list[Literal[NORM_KEYS]] = Field(
        ["norm_before_fc", "norm_output"], description="EAGLE-3.1 norms the draft adds, written to its config as the "
        "keys both engines read (eaglepipe/contract/variants.py): norm_before_fc (one RMSNorm over the aux states "
        "before fc) or fc_norm (one per aux state), norm_before_residual (the layer's residual normed), norm_output "
        "(the normed output feeds the next draft step); [] = the plain EAGLE-3 draft. The default is the pair both "
        "engines serve (benchmarks/peers_quality.json: it lifts τ from the plain draft's level to speculators'); "
        "speculators 0.9.0 also sets norm_before_residual, which SGLang does not read (vLLM-only drafts may add it)")
    ttt_steps: int = Field(3, ge=1, le=16, description="training-time-test unroll: steps the draft runs on its "
                           "own hidden output")
    step_decay: float = Field(0.8, gt=0.0, le=1.0, description="loss weight of TTT step j is step_decay**j")
    epochs: int = Field(6, ge=1, description="passes over the training samples; the epoch with the best held-out "
                        "τ_sim is kept")
    lr: float = Field(3e-3, gt=0.0, description="AdamW peak learning rate (linear warmup, then cosine decay to 0)")
    warmup_steps: int = Field(10, ge=0, description="optimizer steps of linear warmup")
    batch_tokens: int = Field(2048, ge=16, description="tokens per packed row (one micro-batch); a longer sample "
                              "is refused")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    grad_clip: float = Field(0.5, gt=0.0, description="gradient-norm clipping threshold")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="share of the feature samples held out for τ_sim")
    checkpoint_every: int = Field(100, ge=1, description="optimizer steps between checkpoints (a killed run "
                                  "resumes from the last)")
    packing: Literal["greedy", "length"] = Field(
        "greedy", description="rows of ≤ batch_tokens: greedy in shuffled order, or length-grouped (first-fit "
        "decreasing, less padding for fixed-shape batches); both report train padding_fraction")
    seed: int = Field(0, description="seed of the held-out split, the draft's initialization and the packing "
                      "order")
    fast: bool = Field(False, description="fast TTT step (flex attention and torch.compile on CUDA, chunked soft "
                       "cross-entropy); same losses and gradients as the plain step. Online (a tokens "
                       "store) on CUDA it also compiles the target's decoder layers for the capture "
                       "(engines.hf.compile_layers)")
    cuda_graph: bool = Field(False, description="with train.fast on CUDA, one process and grad_accum 1: the whole "
                             "optimizer step (soft targets, TTT unroll, backward, clipping, fused AdamW) replayed "
                             "as one CUDA graph per row shape (eaglepipe/train/graphed.py); same losses as the "
                             "eager fast step. Elsewhere the eager step runs, and the log says why")
    freeze_lm_head: bool = Field(False, description="keep lm_head at its init (the target's draft-vocab rows), "
                                 "as speculators does by default")
    teacher_precision: Literal["fp32", "tf32", "bf16"] = Field(
        "fp32", description="precision of the target lm_head product for the soft targets on CUDA (CPU: fp32)")
    capture_stream: bool = Field(True, description="online training on CUDA: the target's capture of the next "
                                 "rows runs on a CUDA stream of its own, beside the training step (false: on the "
                                 "training's stream, one after the other); same features either way. Only for an "
                                 "eager capture: a compiled one (train.fast with compile_capture) runs in the "
                                 "training thread, where this has no effect")
    compile_capture: bool = Field(True, description="with train.fast, online, on CUDA: the target's decoder layers "
                                  "compiled for the capture (engines.hf.compile_layers). false: the eager capture "
                                  "(then capture_stream applies); same features either way, so a run resumes "
                                  "across it")
    nproc_per_node: int = Field(1, ge=1, description="training processes on this host: above 1 the train_drafter "
                                "stage runs itself again under torchrun (torch.distributed.run --standalone), one "
                                "rank per GPU on CUDA (nccl), processes on the CPU (gloo). Each rank takes every "
                                "nproc_per_node-th micro-batch, so the global batch is nproc_per_node × grad_accum "
                                "rows: lower grad_accum to keep a one-process run's batch")
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp", description="how several ranks share the draft: ddp (each rank a whole copy, gradients all-reduced) "
        "or fsdp (FSDP2 fully_shard: weights, gradients and AdamW state sharded over the ranks, checkpoints one "
        "file a rank; the written draft is the same whole draft). Same loss either way; no effect with one process")


class ServeParams(_Strict):
    """Stage `serve_eval`: how served acceptance and speed are measured, and when the pipeline fails."""

    k: int = Field(3, ge=1, le=16, description="drafted tokens per step")
    max_new_tokens: int = Field(64, ge=1, description="tokens decoded per eval prompt")
    prompts: int = Field(16, ge=1, description="eval prompts measured (MT-bench first turns first, then HumanEval, "
                         "then held-out conversations)")
    batch_sizes: list[Annotated[int, Field(ge=1)] | None] = Field(
        [None], min_length=1, description="concurrency levels the engine is timed at, each on the same two "
        "instances (null: every prompt at once; 1: one request at a time, the latency case); the first gives "
        "the top-level figures, all of them reports' by_batch_size")
    min_tau: float = Field(1.05, ge=1.0, description="serve_eval fails when an engine's τ is below this")
    max_sim_gap: float = Field(0.5, ge=0.0, description="flag a served τ this far below τ_sim or the reference")
    quantization: str | None = Field(None, description="serve the target quantized this way (e.g. 'fp8'; "
                                     "eaglepipe/target/quantization.py); the draft is not quantized")
    engine_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the serving engine computes in (vLLM's fp8 needs bfloat16 or float16)")


class Params(_Strict):
    """All of params.yaml: the boundary layers, the serving engine and one section per stage."""

    layers: list[int] = Field(description="aux boundary indices h[k], ascending, unique, in [0, N-1]")
    framework: Engine = Field("vllm", description="serving engine validated and measured against: vllm | sglang "
                              "| hf")
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs (on a CPU: core groups) the engines shard the target over in regeneration, "
        "extraction, validate_offsets and serve_eval (vLLM tensor_parallel_size, SGLang tp_size); the hf engine "
        "shards it in extraction only (extract.engine: hf, store features, nproc_per_node 1): the stage runs as that "
        "many torchrun ranks with transformers' tp_plan='auto', one GPU (or core share) each")
    expert_parallel: bool = Field(
        False, description="an MoE target's experts split over the tensor_parallel_size ranks instead of each "
        "expert's weights (vLLM enable_expert_parallel, SGLang ep_size = tp_size), wherever tensor_parallel_size "
        "reaches; needs tensor_parallel_size ≥ 2, engines vllm / sglang on CUDA GPUs (their CPU MoE kernels ignore "
        "the split) and a target with experts (the target stage refuses a dense one or a CPU)")
    target: TargetParams = TargetParams()
    prompts: PromptsParams = PromptsParams()
    extract: ExtractParams = ExtractParams()
    validate_: ValidateParams = Field(ValidateParams(), alias="validate")
    train: TrainParams = TrainParams()
    serve: ServeParams = ServeParams()

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: list[int]) -> list[int]:
        problem = list_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _draft_norms(self) -> "Params":
        if (why := combination_problem(self.train.draft_norms)) is not None:
            raise ValueError(f"train.draft_norms {why}")
        return self  # which engine reads which: eaglepipe/contract/variants.py, checked at check_params

    @model_validator(mode="after")
    def _thinking(self) -> "Params":
        mode = self.extract.thinking
        if mode in ("on", "mix") and not self.extract.regenerate:
            raise ValueError(f"extract.thinking: {mode} with extract.regenerate: false: the source's answers hold "
                             "no reasoning the target wrote; set extract.regenerate: true (or thinking: off)")
        if mode != "template" and self.prompts.max_turns > 1:
            raise ValueError(f"extract.thinking: {mode} with prompts.max_turns: {self.prompts.max_turns}: thinking "
                             "templates render an earlier turn's reasoning otherwise than the last's (Qwen3 drops "
                             "it), so one sample cannot hold every turn as the target saw it; set "
                             "prompts.max_turns: 1")
        return self

    @model_validator(mode="after")
    def _parallel_engines(self) -> "Params":
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("expert_parallel: true splits the experts over the tensor_parallel_size ranks, but "
                             "tensor_parallel_size is 1 (one rank holds every expert); set tensor_parallel_size ≥ 2 "
                             "or expert_parallel: false")
        hf = [f"{k}: {v}" for k, v in (("framework", self.framework), ("extract.engine", self.extract.engine),
                                       ("extract.regenerate_engine", self.extract.regenerate_engine)) if v == "hf"]
        if self.expert_parallel and hf:
            raise ValueError(f"expert_parallel splits the experts in vllm or sglang, but {', '.join(hf)} runs the "
                             "hf engine, which has no expert parallelism; use vllm or sglang there, or "
                             "expert_parallel: false")
        problem = hf_tensor_parallel_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @field_validator("extract")
    @classmethod
    def _synthetic_needs_regenerate(cls, v: ExtractParams, info: ValidationInfo) -> ExtractParams:
        prompts = info.data.get("prompts")
        if prompts is not None and prompts.synthetic and not v.regenerate:
            raise ValueError(f"prompts.synthetic = {prompts.synthetic} needs extract.regenerate: true (the target "
                             "writes those conversations' user and assistant turns); set it, or prompts.synthetic: 0")
        return v


def hf_tensor_parallel_problem(p: Params) -> str | None:
    """Why these params cannot run the hf engine at ``tensor_parallel_size`` T > 1, or None.

    Built: extraction (``extract.engine: hf``), whose stage runs as T torchrun ranks forming one hf replica
    (transformers' ``tp_plan="auto"``; eaglepipe/host.py ``Layout``), regenerating with the
    same hf replica. Not built: hf as ``framework`` (validate_offsets, serve_eval's reference decoder), the
    trainer's online hf capture (``extract.store: tokens``), another engine inside hf's ranks, and several hf
    replicas (transformers 5.x's mesh is (pp, fsdp, tp) over the whole world:
    transformers/distributed/utils.py ``initialize_distributed_mesh``)."""
    t, x = p.tensor_parallel_size, p.extract
    if t == 1:
        return None
    head = f"tensor_parallel_size {t} with the hf engine"
    if p.framework == "hf":
        return (f"{head} as framework: validate_offsets and serve_eval run hf on one device; set framework: vllm or "
                "sglang (extract.engine: hf at tensor_parallel_size > 1 is built)")
    if "hf" not in (x.engine, x.regenerate_engine):
        return None
    if x.engine != "hf" or x.regenerate_engine not in (None, "hf"):
        return (f"{head}: extract.engine {x.engine!r} with extract.regenerate_engine {x.regenerate_engine!r}; hf at "
                "tensor_parallel_size > 1 runs as extract's own torchrun ranks, so both must be hf (regenerate_engine "
                "null), or neither")
    if x.store == "tokens":
        return (f"{head}: extract.store tokens makes train_drafter capture online with hf on its one training "
                "device; set extract.store: features, or extract.engine: vllm or sglang")
    if x.nproc_per_node > 1 or x.workers > 1:
        return (f"{head}: extract.nproc_per_node {x.nproc_per_node}, extract.workers {x.workers}; one hf replica "
                f"takes {t} torchrun ranks and transformers 5.x shards over the whole world "
                "(transformers/distributed/utils.py initialize_distributed_mesh: no data-parallel dimension), so set "
                "both to 1, or use engine vllm or sglang for several replicas")
    return None


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(part) for part in e["loc"]) or "<root>"
        key = key.replace("validate_", "validate")
        if e["type"] == "extra_forbidden":
            lines.append(f"params.yaml: unknown key '{key}' (value {e['input']!r}); remove or rename it")
        elif not e["loc"]:  # a rule across sections: the message names its keys
            lines.append(f"params.yaml: {e['msg'].removeprefix('Value error, ')}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"params.yaml: '{key}' = {e['input']!r}: {msg}")
    return "\n".join(lines)


def parse_params(raw: dict) -> Params:
    """Validate a params dict. Raises ParamsError with one line per problem."""
    try:
        params = Params.model_validate(raw or {})
    except ValidationError as e:
        raise ParamsError(_format(e)) from None
    check_quantization(params)
    return params


def check_quantization(p: Params) -> None:
    """Refuse a quantization the chosen engine (and its installed version) does not offer. Raises ParamsError.

    Every stage checks it at start (check_params first): the engine names are params, the version is installed.
    """
    from eaglepipe.target import quantization

    quantization.check("extract.quantization", p.extract.engine, p.extract.quantization, p.extract.engine_dtype)
    quantization.check("validate.quantization", p.framework, p.validate_.quantization, p.validate_.engine_dtype)
    quantization.check("serve.quantization", p.framework, p.serve.quantization, p.serve.engine_dtype)


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``params.yaml``. Raises ParamsError (with key, bad value, what is allowed)."""
    return parse_params(yaml.safe_load(Path(path).read_text()))


def check_layers_against_target(layers: list[int], n_layers: int) -> None:
    """Refuse boundary ids outside [0, N-1] once N is known. Raises ParamsError.

    h[N] (the last layer's output before the final norm) is refused too: extract always captures it as the
    teacher's input (final norm → lm_head gives the soft targets), so as an aux layer it would be captured
    twice. Called by extract before any work (no stage before it reads ``layers`` and knows N).
    """
    bad = [k for k in layers if not 0 <= k <= n_layers]  # N itself: the message below says why
    if bad:
        raise ParamsError(
            f"params.yaml: 'layers' = {layers}: {bad} outside [0, {n_layers - 1}] for this target "
            f"(N = {n_layers} decoder layers; 0 = embeddings, {n_layers - 1} = input of the last layer; "
            f"h[{n_layers}], the last layer's output, is captured anyway as the teacher's input)"
        )
    if n_layers in layers:
        raise ParamsError(
            f"params.yaml: 'layers' = {layers}: h[{n_layers}] is the last layer's output (N = {n_layers}), "
            f"which extract captures anyway as the teacher's input (final norm -> lm_head), so it cannot also "
            f"be an aux layer; the largest usable boundary is {n_layers - 1} (N-1)"
        )
