"""`dvc repro` to serve_eval on a tiny random llama3-RoPE target (issue 9 "done when"), in a temporary repo copy.

Usage: python benchmarks/dvc_repro_llama3.py [WORK_DIR]   (~5 min on 2 CPU cores)
Prints dvc's return code and time, both τ (reference decoder and vLLM), engines.json and the exported RoPE.
Measured 2026-12-01 on the 2-core machine: RC 0 in 301 s; reference τ 1.1009 = vLLM τ 1.1009
(228 rounds = 228 vLLM drafts); validate_offsets cosine 1.0 at offset 0 for h[2], h[3], h[4].
"""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
import test_pipeline as tp  # noqa: E402  (its copy_repo / dvc helpers)

from eaglepipe.target.tiny import build  # noqa: E402

root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama3_repro")
shutil.rmtree(root, ignore_errors=True)
root.mkdir(parents=True)
src = build("llama-llama3", root / "src")
cwd = tp.copy_repo(root / "repo")
words = "the cat sat on a mat while birds sang over quiet hills and rivers ran far away".split()
with open(cwd / "convs.jsonl", "w") as f:
    for i in range(40):
        q = " ".join(words[(i * 3 + j) % len(words)] for j in range(2 + i % 5))
        f.write(json.dumps({"id": f"t{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}]}) + "\n")
p = yaml.safe_load((cwd / "params.yaml").read_text())
p["layers"] = [2, 3, 4]; p["framework"] = "vllm"; p["target"]["source"] = str(src)
p["prompts"].update({"source": "convs.jsonl", "train": 32, "eval": 8, "mtbench": False})
p["extract"].update({"max_new_tokens": 48, "batch_size": 8, "dtype": "float32", "shard_size": 16, "max_length": 128})
p["train"].update({"draft_vocab_size": 96, "epochs": 30, "batch_tokens": 1024, "warmup_steps": 5, "checkpoint_every": 50})
p["serve"].update({"prompts": 8, "max_new_tokens": 32})
(cwd / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "llama3"], cwd=cwd, check=True)
t0 = time.time(); r = tp.dvc(cwd, "repro"); print("RC", r.returncode, round(time.time() - t0), "s")
print((r.stdout + r.stderr)[-3000:])
ev = json.loads((cwd / "metrics/serve_eval.json").read_text())
print("REF", ev["reference"]["tau"], ev["reference"]["acceptance_per_pos"], "VLLM", ev["vllm"]["tau"], ev["vllm"]["acceptance_per_pos"])
print(json.dumps(json.loads((cwd / "data/export/engines.json").read_text())))
print(json.loads((cwd / "data/export/vllm/config.json").read_text())["rope_parameters"])
