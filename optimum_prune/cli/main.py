"""The entry point `main` of `optimum-prune`: parse (`parser.py`), then run the command's function with the CLI's
logging and error handling.

User errors (bad arguments, missing files, unsupported models, an existing output directory...) print one line on
stderr and exit with status 2; `--verbose` adds INFO logging and the traceback. The command modules (`prune.py`,
`spp.py`, `tools.py`, `recovery.py`) and torch are imported only once a command runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback

from .common import _USER_ERRORS
from .parser import PROG, add_prune_arguments, build_parser

__all__ = ["main", "build_parser", "add_prune_arguments", "run_command"]


def _function(run: str):
    module, _, name = run.partition(":")
    return getattr(importlib.import_module(f".{module}", __package__), name)


def run_command(command: str, args: argparse.Namespace, prog: str = PROG) -> int:
    """Run one command with the CLI's logging and error handling (also used by `optimum-cli prune`)."""
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return _function(getattr(args, "run", None) or f"{command}:cmd_{command}")(args)
    except _USER_ERRORS as e:
        if args.verbose:
            traceback.print_exc()
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"{prog} {command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    distributed = importlib.import_module("..utils.distributed", __package__)  # torch: only once a command runs
    joined = (
        not distributed.initialized()
    )  # a process group the command joins (torchrun, accelerate) is left at the end
    try:
        return run_command(args.command, args)
    finally:
        if joined:
            distributed.shutdown()
