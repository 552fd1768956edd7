"""Check an engine on the device: import it, greedy-generate on a tiny random Llama, print versions.

    python3 lab/gpu_engines/check.py vllm      # after: source <(lab/gpu_engines/device.sh env vllm)
    python3 lab/gpu_engines/check.py sglang    # after: source <(lab/gpu_engines/device.sh env sglang)

Run each engine in its own process (they differ in PYTHONPATH and each takes GPU memory).
The model is built with transformers (no hub, no tokenizer: token ids in, token ids out). The HF greedy
continuation is printed beside the engine's; in bf16 a flipped token on a random model is legitimate, so the
script reports equality but fails only when the engine cannot import or generate.
"""

import json
import os
import sys
import time

MODEL_DIR = os.environ.get("CHECK_MODEL_DIR", "/tmp/tiny-llama")
PROMPTS = [[1, 17, 42, 99, 7, 300, 12], [1, 5, 6, 7, 8]]
MAX_NEW = 8


def build_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(MODEL_DIR, "config.json")):
        return
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(MODEL_DIR)


def hf_greedy():
    import torch
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16).cuda().eval()
    outs = []
    for p in PROMPTS:  # plain argmax loop: no logits processors (engines run with ignore_eos)
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            for _ in range(MAX_NEW):
                nxt = m(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        outs.append(ids[0, len(p):].tolist())
    del m
    torch.cuda.empty_cache()
    return outs


def run_vllm():
    import vllm
    from vllm import LLM, SamplingParams

    t = time.time()
    llm = LLM(model=MODEL_DIR, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              gpu_memory_utilization=0.3, max_model_len=256)
    start = time.time() - t
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
    res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    return vllm.__version__, [list(r.outputs[0].token_ids) for r in res], start


def run_sglang():
    import sgl_kernel
    import sglang

    t = time.time()
    eng = sglang.Engine(model_path=MODEL_DIR, skip_tokenizer_init=True, attention_backend="triton",
                        sampling_backend="pytorch", disable_cuda_graph=True, mem_fraction_static=0.3,
                        context_length=256, log_level="error")
    start = time.time() - t
    res = eng.generate(input_ids=PROMPTS, sampling_params={"temperature": 0.0, "max_new_tokens": MAX_NEW,
                                                            "ignore_eos": True})
    eng.shutdown()
    ver = f"{sglang.__version__} (sgl_kernel {getattr(sgl_kernel, '__version__', '?')})"
    return ver, [list(r["output_ids"]) for r in res], start


def main():
    engine = sys.argv[1] if len(sys.argv) > 1 else "vllm"
    import torch
    import transformers
    import triton

    info = {"engine": engine, "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": triton.__version__, "gpu": torch.cuda.get_device_name(0)}
    try:
        import flashinfer
        info["flashinfer"] = flashinfer.__version__
    except Exception as e:  # reported, not fatal
        info["flashinfer"] = f"import failed: {type(e).__name__}: {e}"
    build_model()
    ref = hf_greedy()
    ver, outs, start = run_vllm() if engine == "vllm" else run_sglang()
    info.update(engine_version=ver, startup_s=round(start, 1), hf=ref, engine_out=outs,
                outputs_equal=[a == b for a, b in zip(ref, outs)])
    print("CHECK " + json.dumps(info), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"check_{engine}.json"), "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
