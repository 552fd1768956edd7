"""Benchmark: extraction's capture (hf engine, hooks at layers + h[N]) against a plain HF forward, same batches.

Usage: python benchmarks/capture_overhead.py [TARGET_DIR] [FEATURES_DIR] [N_SAMPLES]
Prints tokens/s of both, the overhead, and the cosine of every stored h[k] of one sample against an
independent HF ``output_hidden_states`` pass (h[N] through the final norm, since HF's last entry is post-norm).
"""

import sys
import time

import torch

from eaglepipe.data.features import FeatureSet
from eaglepipe.engines.hf import HFEngine


def main():
    target = sys.argv[1] if len(sys.argv) > 1 else "data/target"
    features = FeatureSet(sys.argv[2] if len(sys.argv) > 2 else "data/features")
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    samples = features.take(n)
    seqs = [s.input_ids.tolist() for s in samples]
    tokens = sum(map(len, seqs))
    eng = HFEngine(target, batch_size=16)
    ids = features.layers + [features.n_layers]
    eng.capture(seqs[:2], ids)  # warm-up
    t0 = time.perf_counter()
    eng.capture(seqs, ids)
    cap = time.perf_counter() - t0
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # the batches capture() makes
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(order), 16):
            batch = [seqs[i] for i in order[b : b + 16]]
            T = max(map(len, batch))
            x = torch.zeros(len(batch), T, dtype=torch.long)
            m = torch.zeros(len(batch), T, dtype=torch.long)
            for i, s in enumerate(batch):
                x[i, : len(s)], m[i, : len(s)] = torch.tensor(s), 1
            eng.model.model(input_ids=x, attention_mask=m, use_cache=False)
    plain = time.perf_counter() - t0
    print(f"{len(seqs)} samples, {tokens} tokens, batch 16, {torch.get_num_threads()} threads")
    print(f"plain HF forward : {tokens / plain:8.1f} tokens/s")
    print(f"capture (hooks)  : {tokens / cap:8.1f} tokens/s   overhead {100 * (cap / plain - 1):+.1f} %")
    s = samples[0]
    with torch.inference_mode():
        hs = eng.model(s.input_ids[None], output_hidden_states=True).hidden_states
        for j, k in enumerate(features.layers):
            c = torch.nn.functional.cosine_similarity(s.aux[:, j].float(), hs[k][0], dim=-1)
            print(f"sample {s.id}: stored h[{k}] vs HF: min cosine {c.min():.6f}")
        c = torch.nn.functional.cosine_similarity(eng.model.model.norm(s.last.float()), hs[-1][0], dim=-1)
        print(f"sample {s.id}: norm(stored h[{features.n_layers}]) vs HF last: min cosine {c.min():.6f}")


if __name__ == "__main__":
    main()
