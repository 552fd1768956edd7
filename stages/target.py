"""Stage `target`: make the target an HF folder without loading a user's weights.

Usage: python stages/target.py OUT_DIR METRICS_JSON UNQUANTIZED_DIR
Reads params `target`, `extract.engine` (a pre-quantized target is refused here where the hf engine would
capture it, offline or online), `extract.engine` and `framework` (a target one of the engines they name cannot
capture is refused here, naming the engine file: eaglepipe/target/capture_check.py) and `tensor_parallel_size`
(on a GPU, weights that cannot fit at that size are refused here, naming the size that fits; a pre-quantized
scheme the engine has no kernel for on this machine is refused here: eaglepipe/target/checkpoint_quant.py),
`extract.thinking`, `extract.reasoning_effort` and `prompts.max_turns` (what the chat template cannot do is refused
here: no thinking switch, no off or several turns a sample in gpt-oss's harmony form, an effort it does not read:
eaglepipe/target/reasoning.py) and
`expert_parallel` (a dense target, or an engine without it on this device, is refused here:
eaglepipe/target/info.py require_expert_parallel); writes OUT_DIR
(config, tokenizer + chat template, the weights linked or a GGUF dequantized) and METRICS_JSON (N, hidden size,
vocab, dtype, content hash, and a pre-quantized folder's scheme as ``quantization``). A local folder is checked
whole first (eaglepipe/target/folder_check.py: weight files and their headers, tensor names, tokenizer and chat
template or `target.chat_template`, generation config). UNQUANTIZED_DIR holds `target.unquantized`, the float
release of a pre-quantized target (checked to be the same model, then config and tokenizer copied and weights linked:
eaglepipe/target/checkpoint_quant.py check_unquantized), the baseline `validate_offsets` measures the served
checkpoint's numerics gap against; when unset, only a file UNSET.
"""

import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from eaglepipe.atomic import atomic_dir
from eaglepipe.errors import ParamsError
from eaglepipe.stage import run, start, write_metrics
from eaglepipe.target.capture_check import capture_uses, require_capturable
from eaglepipe.target.checkpoint_quant import check_unquantized, checkpoint_scheme, require_runnable
from eaglepipe.target.folder_check import check_folder, check_tokenizer
from eaglepipe.target.info import (check_fits, load_config, materialize_target, reference_target,
                                   refuse_hf_on_quantized, require_expert_parallel, weight_bytes)
from eaglepipe.target.reasoning import require_switch, template_text


def check_config(p, config, source: str) -> None:
    """The refusals that need the target's config: engines that cannot capture it, expert parallelism on a
    dense target. Raises ParamsError."""
    require_capturable(config, source, capture_uses(p.extract.engine, p.framework))
    if p.expert_parallel:
        uses = {}
        regenerate = p.extract.regenerate_engine if p.extract.regenerate else None
        for param, engine in (("extract.engine", p.extract.engine), ("extract.regenerate_engine", regenerate),
                              ("framework", p.framework)):
            if engine:
                uses.setdefault(engine, []).append(f"{param}: {engine}")
        require_expert_parallel(config, source, p.tensor_parallel_size, uses, torch.cuda.is_available())


def main():
    p = start("target")
    out_dir, metrics, unquantized_dir = sys.argv[1:4]
    source, template, unquantized = Path(p.target.source), p.target.chat_template, p.target.unquantized
    scheme = None  # a GGUF is dequantized here: the engines get float weights
    if source.is_dir():  # a local HF folder: checked whole before anything is written
        scheme = checkpoint_scheme(source)
        refuse_hf_on_quantized(source, ["extract.engine: hf"] if p.extract.engine == "hf" else [])
        require_runnable(source, scheme, capture_uses(p.extract.engine, p.framework), not torch.cuda.is_available())
        config = load_config(source)
        check_config(p, config, p.target.source)
        check_folder(source, config, config.get_text_config().vocab_size, template)
        if unquantized:
            check_unquantized(unquantized, p.target.source, source, scheme)
        require_switch(p.extract.thinking, template or template_text(source), p.target.source,
                       p.extract.reasoning_effort, p.prompts.max_turns)
        if torch.cuda.is_available():  # on a CPU the engines hold every rank's shard in one host's memory
            check_fits(weight_bytes(source), p.tensor_parallel_size,
                       torch.cuda.get_device_properties(0).total_memory, torch.cuda.device_count())
    info = materialize_target(p.target.source, out_dir, p.target.dtype, template)
    if not source.is_dir():  # a GGUF: its config and tokenizer exist once dequantized
        try:
            check_config(p, load_config(Path(out_dir)), p.target.source)
            check_tokenizer(Path(out_dir), template)
            require_switch(p.extract.thinking, template_text(out_dir), p.target.source, p.extract.reasoning_effort,
                           p.prompts.max_turns)
            if unquantized:
                check_unquantized(unquantized, p.target.source, out_dir, scheme)
        except ParamsError:
            shutil.rmtree(out_dir)
            raise
    if unquantized:
        reference_target(Path(unquantized), Path(unquantized_dir))
    else:  # nothing to compare against; a file, since DVC warns of an empty out
        with atomic_dir(unquantized_dir) as tmp:
            (tmp / "UNSET").write_text("target.unquantized is unset\n")
    write_metrics(metrics, {**asdict(info), **({"quantization": scheme} if scheme else {}),
                            **({"unquantized": unquantized} if unquantized else {})})


if __name__ == "__main__":
    run(main)
