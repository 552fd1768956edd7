"""SGLang 0.5.17 under the H200 image's transformers 5.17 (SGLang pins 5.12.1): on PYTHONPATH for SGLang only.

SGLang registers configs that transformers 5.17 ships itself (``sglang/srt/configs/qwen3_asr.py``:
``AutoConfig.register("qwen3_asr", ...)`` → "'qwen3_asr' is already used by a Transformers config", seen on
the H200), so registration is made ``exist_ok``: transformers' own class stays, SGLang's is used by SGLang.
"""

try:
    from transformers.models.auto import auto_factory as _af
    from transformers.models.auto import configuration_auto as _ca

    for _cls in (_ca._LazyConfigMapping, _af._LazyAutoMapping):
        def _register(self, key, value, exist_ok=False, _orig=_cls.register):
            return _orig(self, key, value, exist_ok=True)

        _cls.register = _register
except Exception:  # noqa: BLE001 — no transformers, or another layout: leave registration as it is
    pass
