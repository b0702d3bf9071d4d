"""`batchspec` command line: a thin layer over the library API. Every failure a user can cause prints one line.

One module per subcommand (`generate.py`, `bench.py`, `distill.py`, `sprinter.py`, `serve.py`, `sim.py`,
`fetch.py`), each adding its parser and the `cmd_*` it runs, over the shared options of `options.py`.
"""

from __future__ import annotations

import argparse
import sys

from batchspec.cli.bench import add_bench_parser
from batchspec.cli.distill import add_distill_parser
from batchspec.cli.fetch import add_fetch_parser
from batchspec.cli.generate import add_generate_parser
from batchspec.cli.options import Parser
from batchspec.cli.serve import add_serve_parser
from batchspec.cli.sim import add_sim_parser
from batchspec.cli.sprinter import add_sprinter_parser
from batchspec.errors import BatchspecError


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="batchspec", description="Batch speculative decoding on CPU and GPU.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for add_parser in (add_generate_parser, add_bench_parser, add_distill_parser, add_sprinter_parser,
                       add_serve_parser, add_sim_parser, add_fetch_parser):
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from batchspec.runtime.threads import configure_threads

        configure_threads()
        return args.run(args)
    except BatchspecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
