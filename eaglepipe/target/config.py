"""The target's HF ``config.json``: read here and nowhere else.

:class:`eaglepipe.target.info.TargetInfo` (family, N, hidden, vocab, RoPE, dtype) is built from it once; readers
that need raw fields no TargetInfo holds (the draft's shape in :mod:`eaglepipe.model.draft`, the head's norm eps
in :mod:`eaglepipe.model.target_head`, token ids in :mod:`eaglepipe.serving.export`) call :func:`read_target_config`.
A leaf module: training reads the target's config without depending on the layer-id rules.
"""

from __future__ import annotations

import json
from pathlib import Path

from eaglepipe.errors import EaglepipeError

CONFIG_FILE = "config.json"


def read_target_config(path: str | Path) -> dict:
    """The ``config.json`` dict of a target folder (or of a ``.json`` file given directly).

    Raises EaglepipeError when it is missing or not valid JSON.
    """
    path = Path(path)
    return read_json(path / CONFIG_FILE if path.is_dir() else path)


def has_config(folder: str | Path) -> bool:
    """Whether ``folder`` is an HF model folder (holds a ``config.json``)."""
    return (Path(folder) / CONFIG_FILE).is_file()


def read_json(file: str | Path) -> dict:
    """A JSON file's content. Raises EaglepipeError when it is missing or not valid JSON (one line, no traceback)."""
    file = Path(file)
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise EaglepipeError(f"{file}: not found") from None
    except json.JSONDecodeError as e:
        raise EaglepipeError(f"{file}: not valid JSON ({e})") from None


def write_target_config(folder: str | Path, cfg: dict) -> None:
    """Rewrite a target folder's ``config.json`` (used where a saved folder must declare another model_type)."""
    (Path(folder) / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))


def wraps_language_model(cfg: dict) -> bool:
    """Whether a target config is a multimodal wrapper around its language model (a ``text_config``: Qwen2.5-VL,
    Kimi-K2.5, Gemma-3)."""
    return isinstance(cfg.get("text_config"), dict)


def lm_fields(cfg: dict) -> dict:
    """The language model's fields of a target config: ``text_config`` for multimodal wrappers (gemma3)."""
    return cfg.get("text_config", cfg)
