"""The ``inferscale`` command. Subcommands import their modules lazily so ``--help`` and the operator stay light."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from inferscale import __version__

# Each subcommand: (module, help). The module provides add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "encode": ("inferscale.commands.encode", "encode a JSONL of memories into KV blobs"),
    "ask": ("inferscale.commands.ask", "answer a question with memories from a blobs dir"),
    "keys": ("inferscale.commands.keys", "KEK file: add a key first, re-wrap a store's sealed blobs under it"),
    "serve": ("inferscale.server.cli", "run the OpenAI-compatible server (single node)"),
    "plan": ("inferscale.commands.plan", "capacity planner: storage, hit rates, fetch times and nodes for your users"),
    "demo": ("inferscale.server.demo", "load sample memories into a running server and compare kv vs text TTFT"),
}
# The operator owns its flags (inferscale.operator.cli); it is handed the rest of the command line as is.
OPERATOR_HELP = "run the Kubernetes operator (flags: inferscale operator --help)"
BENCHES: dict[str, tuple[str, str]] = {
    "ttft": ("inferscale.bench.ttft", "TTFT vs k: text vs kv (warm, cold) vs the floor"),
    "store": ("inferscale.bench.store", "moving 50 blocks into DRAM: NIXL vs plain baselines"),
    "locomo": ("inferscale.bench.locomo", "quality on LoCoMo: F1 and agreement per mode"),
    "load": ("inferscale.bench.load", "concurrent streams through the real server: tokens/s, TTFT, TPOT; kv vs text"),
    "step": ("inferscale.bench.step", "the engine's decode step alone at N rows vs 1, against the floor"),
    "isolation": ("inferscale.bench.isolation", "timing audit: can tenant B see tenant A's memories or activity (KS)"),
    "fleet": ("inferscale.bench.fleet", "TTFT when the k blocks come from a peer over NIXL vs DRAM vs text"),
    "replay": ("inferscale.bench.replay", "a Zipf trace through the real server: DRAM hit rate and fetch times vs plan"),
}


def build_parser(chosen: list[str]) -> argparse.ArgumentParser:
    """The parser; only the chosen subcommand's module is imported (for its flags), so ``--help`` stays light and
    the operator's image needs no torch. ``chosen`` is argv without options: [command] or ["bench", name]."""
    parser = argparse.ArgumentParser(prog="inferscale", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(subparsers, name: str, module: str, help: str, selected: bool) -> None:
        p = subparsers.add_parser(name, help=help, description=help)
        p.set_defaults(_module=module)
        if selected:
            importlib.import_module(module).add_arguments(p)

    for name, (module, help) in COMMANDS.items():
        add(sub, name, module, help, chosen[:1] == [name])
    sub.add_parser("operator", help=OPERATOR_HELP, add_help=False)  # dispatched before parsing, see main()
    bench = sub.add_parser("bench", help="benchmarks (print a table and write JSON)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help) in BENCHES.items():
        add(bench_sub, name, module, help, chosen[:2] == ["bench", name])
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download from a model hub
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    argv = sys.argv[1:] if argv is None else argv
    # The operator parses its own flags: everything after the word, plus a -v given before it.
    head = argv[:argv.index("operator")] if "operator" in argv else None
    if head is not None and all(a in ("-v", "--verbose") for a in head):
        from inferscale.operator.cli import main as operator_main

        return operator_main((["--verbose"] if head else []) + argv[len(head) + 1:])
    positional = [a for a in argv if not a.startswith("-")]
    try:
        parser = build_parser(positional[:2])
    except ModuleNotFoundError as e:
        print(f"inferscale: this install lacks a dependency of '{' '.join(positional[:2])}': {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
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
