"""The ``eaglepipe`` command. One function per subcommand; add a subcommand with ``_add_<name>`` + ``_run_<name>``.

Exit codes: 0 = fine, 1 = the command ran and found a problem, 2 = it could not run (bad input).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from eaglepipe.errors import EaglepipeError


def _add_inspect(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="which boundaries SGLang and vLLM would feed an EAGLE-3 draft, and whether its weights fit",
        description="Inspect an EAGLE-3 draft folder (SGLang/SpecForge, ModelOpt, speculators, vLLM, EAGLE, "
        "eaglepipe formats) against a target config.",
    )
    p.add_argument("draft_dir", help="draft folder holding config.json (+ *.safetensors)")
    p.add_argument("--target", required=True, help="target HF folder or its config.json")
    p.add_argument("--sglang-version", help="apply this SGLang version's rules (default: installed, else verified)")
    p.add_argument("--vllm-version", help="apply this vLLM version's rules (default: installed, else verified)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_run_inspect)


def _run_inspect(args) -> int:
    from eaglepipe.contract.inspect import format_report, inspect_draft

    versions = {"sglang": args.sglang_version, "vllm": args.vllm_version}
    report = inspect_draft(args.draft_dir, args.target, {k: v for k, v in versions.items() if v})
    if args.json:
        print(json.dumps({**dataclasses.asdict(report), "ok": report.ok}, indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglepipe", description="EAGLE-3 draft models for SGLang and vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_inspect(sub)
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
