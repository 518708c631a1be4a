"""`megarl plot`: PNG curves of runs' metrics.jsonl, overlaid."""

from __future__ import annotations

import argparse


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
    parser.add_argument("--out", help="where the PNGs go (default: the first run's directory / plots)")
    parser.add_argument("--x", default="step", choices=["step", "samples", "time"], help="the x axis")
    parser.add_argument("--label", action="append", help="a run's name in the legend, once per run, in order")
    parser.add_argument(
        "--band", action="store_true", help="runs that share a --label: one line, their mean with a 95%% t-band"
    )


def run(args: argparse.Namespace) -> None:
    from megarl.plot import plot_runs

    plot_runs(args.runs, args.out, args.x, args.label, args.band)
