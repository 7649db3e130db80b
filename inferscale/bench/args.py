"""Command-line options the timing benches share: which model, on what device, in what dtype."""

from __future__ import annotations

import argparse


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name or path (default: embedded gemma-3-270m)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--random-weights", default=None, metavar="SHAPE",
                   help="time a random-weight model of this shape instead of --model (llama3-8b, llama-tiny)")
