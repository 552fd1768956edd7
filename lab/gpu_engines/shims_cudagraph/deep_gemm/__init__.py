"""Stand-in for DeepGEMM, on PYTHONPATH only for SGLang EAGLE-3 serving with CUDA graphs of a non-DeepSeek target
(suite.sh draft-sglang's first attempt), together with ``SGLANG_ENABLE_JIT_DEEPGEMM=0``.

Why (read in the SGLang 0.5.17 wheel): ``speculative/eagle_worker_v2.py`` (the draft-extend CUDA-graph set-up,
l. ~417) imports ``layers/attention/dsa_backend.py`` on every CUDA machine, and that module runs ``import
deep_gemm`` at import time (l. 90); DeepGEMM is not carried to the H200, so SGLang EAGLE-3 could start only
with ``disable_cuda_graph``. The one probe that would then switch DeepGEMM kernels on,
``layers/deep_gemm_wrapper/configurer.py _compute_enable_deep_gemm``, also reads ``SGLANG_ENABLE_JIT_DEEPGEMM``,
which the step sets to 0 (an earlier stand-in without it broke the DeepSeek path: with the probe on,
``deep_gemm_wrapper/entrypoint.py`` imports ``deep_gemm.utils.layout``). ``hasattr`` probes
(``moe/mega_moe_sm90.py``) see no attribute. Any real use fails loudly instead of computing something else.
"""


def __getattr__(name: str):
    raise AttributeError(f"deep_gemm.{name}: DeepGEMM is not carried to this machine (lab/gpu_engines/"
                         "shims_cudagraph/deep_gemm); only DeepSeek sparse-attention or FP8 paths need it")
