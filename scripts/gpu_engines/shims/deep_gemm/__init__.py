"""Stand-in for DeepGEMM, which the carried SGLang set does not include (on PYTHONPATH for SGLang only).

SGLang 0.5.17 imports ``deep_gemm`` at the top of ``sglang/srt/layers/attention/dsa_backend.py`` (DeepSeek
sparse attention), and its EAGLE worker (``speculative/eagle_worker_v2.py _capture_cuda_graphs``) imports that
module whenever it captures CUDA graphs, for any target. Seen on the H200: "ModuleNotFoundError: No module
named 'deep_gemm'", so SGLang EAGLE-3 could only run with ``disable_cuda_graph``. Nothing outside DSA targets
calls into DeepGEMM; any use here fails loudly instead of computing something else.
"""


def __getattr__(name: str):
    raise AttributeError(f"deep_gemm.{name}: DeepGEMM is not carried to this machine (scripts/gpu_engines/shims/"
                         "deep_gemm); only DeepSeek sparse-attention (DSA) targets need it")
