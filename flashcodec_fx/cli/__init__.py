"""The ``flashcodec`` command: ``run`` (the main job), ``bench`` (the benchmarks), ``demo`` (the Gradio app),
``info`` (versions, device, active kernels). ``flashcodec COMMAND --help`` describes each."""

from __future__ import annotations

import argparse
import os
import sys

from . import bench, demo, info, run
from .errors import USAGE_ERROR, CLIError

COMMANDS = (run, bench, demo, info)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashcodec", description=__doc__)
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"flashcodec_fx {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(ours, theirs)``: ``bench NAME ARGS...`` and ``demo ARGS...`` hand ARGS to the benchmark / app untouched
    (``flashcodec demo --help`` is this command's help; ``flashcodec demo -- --help`` the app's)."""
    if argv[:1] == ["bench"] and len(argv) > 2 and not argv[1].startswith("-"):
        return argv[:2], argv[2:]
    if argv[:1] == ["demo"] and argv[1:] not in ([], ["-h"], ["--help"]):
        rest = argv[1:]
        return argv[:1], rest[1:] if rest[0] == "--" else rest
    return argv, []


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flashcodec`` console script; returns the exit status."""
    ours, theirs = split_passthrough(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(ours)
    args.args = theirs
    try:
        return args.handler(args)
    except CLIError as err:
        print(f"flashcodec {args.command}: {err}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(f"flashcodec {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout piped into `head` or the like, which stopped reading
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 1
