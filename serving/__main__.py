"""Command-line entry: ``python -m serving <subcommand>``.

Subcommands:
  demo   a ragged batch through the page pool, append and decode attention, checked against a
         dense float64 attention; prints the page table, the backend used and the error.
"""

from __future__ import annotations

import argparse
import sys

from serving.demo import run_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="paged KV cache demonstration")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "reference", "pallas"),
        help="decode attention backend (auto: the Pallas kernel on a GPU, the reference elsewhere)",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(seed=args.seed, backend=args.backend)
    return 2


if __name__ == "__main__":
    sys.exit(main())
