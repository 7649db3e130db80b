"""The ``inferscale`` command. Subcommands import their modules lazily so ``--help`` and the operator stay light."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# Each subcommand: (module, help). The module provides add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "encode": ("inferscale.commands.encode", "encode a JSONL of memories into KV blobs"),
    "ask": ("inferscale.commands.ask", "answer a question with memories from a blobs dir"),
    "serve": ("inferscale.server.cli", "run the OpenAI-compatible server (single node)"),
    "demo": ("inferscale.server.demo", "load sample memories into a running server and compare kv vs text TTFT"),
    "operator": ("inferscale.operator.cli", "run the Kubernetes operator"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "ttft": ("inferscale.bench.ttft", "TTFT vs k: text vs kv (warm, cold) vs the floor"),
    "store": ("inferscale.bench.store", "moving 50 blocks into DRAM: NIXL vs plain baselines"),
    "locomo": ("inferscale.bench.locomo", "quality on LoCoMo: F1 and agreement per mode"),
}


def _add(sub, name: str, module: str, help: str) -> None:
    p = sub.add_parser(name, help=help, description=help)
    p.set_defaults(_module=module)
    if "--help" in sys.argv or "-h" in sys.argv or name in sys.argv[1:3]:
        # Only the chosen command's module is imported (the operator image has no torch).
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:
            p.set_defaults(_missing=str(e))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferscale", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help) in COMMANDS.items():
        _add(sub, name, module, help)
    bench = sub.add_parser("bench", help="benchmarks (print a table and write JSON)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help) in BENCHES.items():
        _add(bench_sub, name, module, help)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download from a model hub
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    argv = sys.argv[1:] if argv is None else argv
    sys.argv = [sys.argv[0], *argv]
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "_missing", None):
        print(f"inferscale: this install lacks a dependency of '{args.command}': {args._missing}", file=sys.stderr)
        return 2
    from inferscale.errors import InferScaleError

    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except InferScaleError as e:
        print(f"inferscale: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
