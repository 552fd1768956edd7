"""A user's local HF folder checked whole by the target stage before anything is written: every later stage
loads it, and a broken download found by `extract` an hour in is found here in seconds, without loading weights.

What is checked, each refusal a ParamsError naming the file and the fix (exit 2, nothing written):
1. Weight files: every file an index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``) names
   exists (links followed); every safetensors file's header is read (8-byte length + JSON, the safetensors format)
   and its tensors lie inside the file (a truncated download ends before its last tensor); every tensor an index
   maps to a file is in that file's header.
2. Tensor names: where transformers loads the architecture's checkpoint names as they are (no weight conversion
   registered for it: ``transformers.conversion_mapping.get_model_conversion_mapping``), the model built from
   config.json on the meta device (no memory) has a weight for each of its parameters and persistent buffers. A
   pre-quantized linear's packed weight stands for its ``weight`` (:data:`PACKED_WEIGHTS`).
3. Tokenizer: it loads (transformers' AutoTokenizer) and has a chat template, or ``target.chat_template`` gives one.
4. generation_config.json, where present: valid JSON, token ids inside the vocabulary, positive lengths.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eaglepipe.errors import ParamsError

log = logging.getLogger(__name__)

INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
MAX_HEADER = 100 << 20  # bytes: safetensors refuses larger headers (safetensors/src/tensor.rs MAX_HEADER_SIZE)
# Where a pre-quantized checkpoint stores a linear's weight packed under another name: compressed-tensors'
# pack-quantized and NVFP4 formats (compressed_tensors/compressors/pack_quantized/base.py, nvfp4/base.py:
# ``weight_packed``), GPTQ and AWQ (vLLM's quantization/auto_gptq.py, auto_awq.py: ``qweight``).
PACKED_WEIGHTS = ("weight_packed", "qweight")
FETCH = "download the missing files again (e.g. `hf download REPO --local-dir FOLDER`) or point target.source elsewhere"


def safetensors_names(file: Path) -> set[str]:
    """The tensor names in a safetensors file's header, reading the header only. Raises ParamsError when the file
    is unreadable, its header is not safetensors', or a tensor's bytes lie past the file's end (truncated)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > min(MAX_HEADER, size - 8):
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise ParamsError(f"target.source: {file} is not a readable safetensors file ({e}); {FETCH}") from None
    header.pop("__metadata__", None)
    end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    if 8 + n + end > size:
        raise ParamsError(f"target.source: {file} is truncated: its header places tensor data up to byte "
                          f"{8 + n + end:,}, the file has {size:,}; {FETCH}")
    return set(header)


def check_weight_files(folder: Path) -> dict[str, set[str]]:
    """Every weight file the folder's indexes name exists, every safetensors header reads, every indexed tensor
    is in its file (module docstring, 1). Returns safetensors file name → its tensor names."""
    names = {}
    for f in sorted(folder.glob("*.safetensors")):
        if not f.exists():
            raise ParamsError(f"target.source: {f} is a link to a missing file ({f.resolve()}); {FETCH}")
        names[f.name] = safetensors_names(f)
    for index in (folder / i for i in INDEXES):
        if not index.is_file():
            continue
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ParamsError(f"target.source: {index} is not an index with a weight_map ({e!r}); {FETCH}") from None
        for file in sorted(set(weight_map.values())):
            if not (folder / file).exists():
                raise ParamsError(f"target.source: {index.name} names {file}, which is missing from {folder}; {FETCH}")
        for tensor, file in sorted(weight_map.items()):
            if file in names and tensor not in names[file]:
                raise ParamsError(f"target.source: {index.name} maps {tensor} to {file}, whose header has no such "
                                  f"tensor; the index and the weight files come from different downloads: {FETCH}")
    return names


def missing_tensors(config, names: set[str]) -> list[str] | None:
    """The parameter and persistent-buffer names of ``config``'s causal-LM model (built on the meta device) that
    ``names`` lacks; None where transformers cannot say: it has no causal-LM class for the config, or converts
    the checkpoint's names on load (fused experts, renamed prefixes)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        from transformers.conversion_mapping import get_model_conversion_mapping  # transformers ≥ 5

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        converts = get_model_conversion_mapping(model, add_legacy=False)
    except (ValueError, KeyError, TypeError, ImportError, NotImplementedError) as e:
        log.info("target tensor names not checked: transformers cannot say for this config (%s)", str(e)[:120])
        return None
    if converts:
        log.info("target tensor names not checked: transformers converts %s checkpoints' names when loading",
                 type(model).__name__)
        return None
    tied = ({n for n, _ in model.named_parameters(remove_duplicate=False)}
            - {n for n, _ in model.named_parameters()})  # a tied weight is saved once, under its first name
    return sorted(set(model.state_dict()) - tied - names)  # parameters and persistent buffers


def check_tensor_names(folder: Path, config, names: dict[str, set[str]]) -> None:
    """Refuse a safetensors folder whose tensors do not cover what ``config``'s architecture needs (module
    docstring, 2); ``names``: :func:`check_weight_files`' result. Folders of .bin weights are not read."""
    if not names:
        return
    stored = set().union(*names.values())
    stored |= {n.rsplit(".", 1)[0] + ".weight" for n in stored if n.rsplit(".", 1)[-1] in PACKED_WEIGHTS}
    missing = missing_tensors(config, stored)
    if missing:
        raise ParamsError(
            f"target.source: the weight files in {folder} lack {len(missing)} tensors that "
            f"{type(config).__name__} needs (transformers' model built from config.json, on the meta device): "
            f"{', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}. The weights are incomplete or belong to "
            f"another config.json; {FETCH}")


def check_tokenizer(folder: Path, chat_template: str) -> None:
    """The tokenizer loads and has a chat template, or ``chat_template`` (params ``target.chat_template``) gives
    one (module docstring, 3). Raises ParamsError naming the files and the fix."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # transformers raises many kinds for a missing or broken tokenizer
        raise ParamsError(f"target.source: the tokenizer in {folder} does not load with transformers' "
                          f"AutoTokenizer ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                          "it needs tokenizer.json or the model's own tokenizer files, and tokenizer_config.json; "
                          f"{FETCH}") from None
    if not tok.chat_template and not chat_template:
        raise ParamsError(
            f"target.source: the tokenizer in {folder} has no chat template (no chat_template in "
            "tokenizer_config.json, no chat_template.jinja), and extract renders every conversation with it. Set "
            "target.chat_template in params.yaml to the model's template (Jinja text; written to "
            "data/target/chat_template.jinja), e.g. ChatML: \"{% for m in messages %}{{ '<|im_start|>' + m['role'] + "
            "'\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\\n' }}{% endif %}\"")


def check_generation_config(folder: Path, vocab_size: int) -> None:
    """generation_config.json, where present: valid JSON, special token ids in [0, vocab_size), positive lengths
    (module docstring, 4); the engines read it for stop tokens and default sampling."""
    file = folder / "generation_config.json"
    if not file.is_file():
        return
    try:
        gen = json.loads(file.read_text())
    except ValueError as e:
        raise ParamsError(f"target.source: {file} is not valid JSON ({e}); fix or delete it") from None
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        ids = gen.get(key)
        for i in ids if isinstance(ids, list) else [] if ids is None else [ids]:
            if not isinstance(i, int) or not 0 <= i < vocab_size:
                raise ParamsError(f"target.source: {file} sets {key} {ids!r}, outside the vocabulary of "
                                  f"{vocab_size} tokens (config.json vocab_size); fix it or delete the file")
    for key in ("max_length", "max_new_tokens"):
        if key in gen and gen[key] is not None and not (isinstance(gen[key], int) and gen[key] > 0):
            raise ParamsError(f"target.source: {file} sets {key} {gen[key]!r}; it must be a positive integer")


def check_folder(folder: Path, config, vocab_size: int, chat_template: str) -> None:
    """All of the module docstring's checks on the local HF folder ``folder`` with its transformers ``config``."""
    names = check_weight_files(folder)
    check_tensor_names(folder, config, names)
    check_tokenizer(folder, chat_template)
    check_generation_config(folder, vocab_size)
