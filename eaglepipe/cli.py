"""The ``eaglepipe`` command. One function per subcommand; add a subcommand with ``_add_<name>`` + ``_run_<name>``.

Exit codes: 0 = fine, 1 = the command ran and found a problem, 2 = it could not run (bad input).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from eaglepipe.errors import EaglepipeError


def _add_versions(p) -> None:
    """The engine versions whose layer-id rules a command applies (inspect, diagnose)."""
    p.add_argument("--sglang-version", help="apply this SGLang version's rules (default: installed, else verified)")
    p.add_argument("--vllm-version", help="apply this vLLM version's rules (default: installed, else verified)")


def _versions(args) -> dict[str, str]:
    return {k: v for k, v in {"sglang": args.sglang_version, "vllm": args.vllm_version}.items() if v}


def _add_inspect(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="which boundaries SGLang and vLLM would feed an EAGLE-3 draft, and whether its weights fit",
        description="Inspect an EAGLE-3 draft folder (SGLang/SpecForge, ModelOpt, speculators, vLLM, EAGLE, "
        "eaglepipe formats) against a target config: one verdict per engine, then notes (information), "
        "WARNING lines (what the folder cannot tell, e.g. the RoPE a foreign draft was trained with) and "
        "PROBLEM lines (what breaks serving). Exit 0 without problems (warnings allowed), 1 with any.",
    )
    p.add_argument("draft_dir", help="draft folder holding config.json (+ *.safetensors)")
    p.add_argument("--target", required=True, help="target HF folder or its config.json")
    _add_versions(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_run_inspect)


def _run_inspect(args) -> int:
    from eaglepipe.contract.inspect import format_report, inspect_draft

    report = inspect_draft(args.draft_dir, args.target, _versions(args))
    if args.json:
        print(json.dumps({**dataclasses.asdict(report), "ok": report.ok}, indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


def _add_diagnose(sub) -> None:
    p = sub.add_parser(
        "diagnose",
        help="which boundaries h[k] a draft was trained on, measured on the target; the ids each engine needs",
        description="Score an EAGLE-3 draft folder (eaglepipe, SGLang/SpecForge, ModelOpt, speculators formats) on "
        "the target (transformers, fp32, CUDA when there is one) under candidate boundary sets: what the folder "
        "states, what each engine feeds, the engines' defaults, their shifts, then a search. The set whose "
        "acceptance stands out is the one it was trained on; then each engine: does it feed that set, and which "
        "ids its config needs. Exit 0 when found and fed by every engine that loads the folder, 1 otherwise.",
    )
    p.add_argument("draft_dir", help="draft folder holding config.json + *.safetensors")
    p.add_argument("--target", required=True, help="target HF folder (config, weights, tokenizer)")
    p.add_argument("--prompts", default="mtbench",
                   help="conversations (.json/.jsonl, eaglepipe/ShareGPT/OpenAI messages) or 'mtbench' (default)")
    p.add_argument("--prompts-n", type=int, default=8, help="prompts used, their first user turns (default 8)")
    p.add_argument("--max-new", type=int, default=64, help="greedy tokens the target writes per prompt (default 64)")
    p.add_argument("--text", choices=("greedy", "conversation"), default="greedy",
                   help="score on the target's greedy continuations (default) or on the conversations' own "
                   "assistant turns (how a draft trained on that data without regeneration saw it)")
    p.add_argument("--no-search", action="store_true", help="score the starting sets only, no coordinate ascent")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf",  # diagnose.HF, diagnose.SERVED (no torch here)
                   help="whose capture the draft reads: transformers' (default) or the installed vLLM's, as it "
                   "serves the target (its kernels, its quantized checkpoint)")
    p.add_argument("--engine-dtype", default="float32", help="the dtype vLLM serves the target in (--engine vllm; "
                   "bfloat16 as on a GPU)")
    _add_versions(p)
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.set_defaults(run=_run_diagnose)


def _run_diagnose(args) -> int:
    from eaglepipe.data.prompts import prompt_records
    from eaglepipe.serving.diagnose import SERVED, diagnose, format_diagnosis

    records = prompt_records(args.prompts)
    if args.engine == SERVED:  # vLLM logs to stdout by default (vllm/envs.py): keep stdout for the report
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    d = diagnose(args.draft_dir, args.target, records, args.prompts_n, args.max_new, not args.no_search,
                 _versions(args), text=args.text, engine=args.engine, engine_dtype=args.engine_dtype)
    print(json.dumps(d.to_json(), indent=2) if args.json else format_diagnosis(d))
    return 0 if d.ok else 1


def _add_probe(sub) -> None:
    p = sub.add_parser(
        "probe",
        help="a running vLLM server's acceptance, from its own metrics, against the τ the draft should reach",
        description="Send prompts (token ids, greedy, all at once) to a running `vllm serve ... --speculative-config` "
        "over its OpenAI API, read its spec-decode counters from /metrics before and after, and print the served τ "
        "and acceptance per position; with --expect, name a server accepting less than half the expected drafted "
        "tokens per step, with the likely causes. Exit 0 unless it accepts far less (1).",
    )
    p.add_argument("url", help="the server, http://host:port")
    p.add_argument("--target", required=True, help="target HF folder (its tokenizer renders the prompts)")
    p.add_argument("--prompts", default="mtbench", help="conversations (.json/.jsonl) or 'mtbench' (default); "
                   "serve_eval's own: data/prompts/eval.jsonl")
    p.add_argument("--prompts-n", type=int, default=16, help="first user turns sent (default 16, as serve.prompts)")
    p.add_argument("--max-new", type=int, default=64, help="tokens per completion (default 64, as serve_eval)")
    p.add_argument("--concurrency", type=int, help="requests at a time (default: all at once; serve_eval's "
                   "serve.batch_sizes)")
    p.add_argument("--expect", help="expected τ: serve_eval's report/metrics JSON (metrics/serve_eval.json), or a "
                   "number")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=_run_probe)


def _run_probe(args) -> int:
    from transformers import AutoTokenizer

    from eaglepipe.data.prompts import prompt_records
    from eaglepipe.serving.evaluate import eval_prompts
    from eaglepipe.serving.probe import expected_tau, format_probe, probe

    tok = AutoTokenizer.from_pretrained(args.target)
    prompts = [q["input_ids"] for q in eval_prompts(tok, prompt_records(args.prompts), args.prompts_n)]
    r = probe(args.url, prompts, args.max_new, expected_tau(args.expect) if args.expect else None, args.concurrency)
    print(json.dumps(r, indent=2) if args.json else format_probe(r))
    return 1 if r["verdict"] == "accepts far less" else 0


# An argument ``dvc exp run`` refuses (unrecognized), printed in place of the arguments when the profile is bad:
# ``dvc exp run $(eaglepipe profile P)`` then stops before any stage instead of running on params.yaml alone.
PROFILE_FAILED = "--eaglepipe-profile-failed"


def _add_profile(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="a params profile as `dvc exp run -S` arguments: dvc exp run $(eaglepipe profile profiles/gpu.yaml)",
        description="Print the `dvc exp run` arguments (-S key.path=value, one argument per line) that apply the "
        "profiles, in order, over params.yaml, after validating the result. Values with spaces do not survive "
        "the shell's $(...); pass the lines as they are: mapfile -t a < <(eaglepipe profile P); "
        'dvc exp run "${a[@]}". On a bad profile the reason goes to stderr, and stdout gets only '
        f"{PROFILE_FAILED}, which dvc exp run refuses before running anything.",
    )
    p.add_argument("profiles", nargs="+", help="profile YAML files (e.g. profiles/gpu.yaml), later ones winning")
    p.add_argument("--params", default="params.yaml", help="the params file they apply over (default params.yaml)")
    p.set_defaults(run=_run_profile)


def _run_profile(args) -> int:
    from eaglepipe.errors import ParamsError
    from eaglepipe.profiles import profile_sets

    try:
        sets = profile_sets(*args.profiles, params_path=args.params)
    except ParamsError:
        print(PROFILE_FAILED)
        raise
    spaced = [a.split("=", 1)[0] for a in sets if any(c.isspace() for c in a)]
    if spaced:
        print(f"eaglepipe profile: {', '.join(spaced)} hold(s) whitespace, which $(...) would split: use "
              'mapfile -t a < <(eaglepipe profile ...); dvc exp run "${a[@]}"', file=sys.stderr)
    print("\n".join(sets))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglepipe", description="EAGLE-3 draft models for SGLang and vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_inspect(sub)
    _add_diagnose(sub)
    _add_probe(sub)
    _add_profile(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except EaglepipeError as e:
        print(f"eaglepipe {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
