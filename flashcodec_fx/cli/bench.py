"""``flashcodec bench NAME [ARGS...]``: run one of the benchmarks of a source checkout (``benchmarks/bench_NAME.py``)
with ARGS passed on; without NAME, list them. Results land where each benchmark says (``--out`` where it has one)."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

from .errors import CLIError

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PREFIX = "bench_"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark of benchmarks/ by name (no name: list them)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", default=None, help="benchmark name, e.g. ppl (or bench_ppl)")
    parser.add_argument("args", nargs="*", metavar="ARGS", help="arguments for the benchmark (e.g. --quick, --help)")
    parser.set_defaults(handler=run)


def scripts(folder: Path | None = None) -> dict[str, Path]:
    """``{name: path}`` of the ``bench_*.py`` scripts in ``folder`` (default :data:`BENCHMARKS`; name without the
    prefix)."""
    folder = BENCHMARKS if folder is None else folder
    if not folder.is_dir():
        raise CLIError(f"no benchmarks folder at {folder}: the benchmarks come with a source checkout "
                       f"(git clone, then pip install -e '.[hf]')")
    return {path.stem[len(PREFIX):]: path for path in sorted(folder.glob(f"{PREFIX}*.py"))}


def summary(path: Path) -> str:
    """First line of the script's docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def run(args: argparse.Namespace) -> int:
    found, found_in = scripts(), BENCHMARKS
    if args.name is None:
        width = max(map(len, found), default=0)
        for name, path in found.items():
            print(f"{name:<{width}}  {summary(path)}")
        print(f"\nflashcodec bench NAME --help: a benchmark's options (scripts in {found_in})")
        return 0
    name = args.name[len(PREFIX):] if args.name.startswith(PREFIX) else args.name
    if name not in found:
        raise CLIError(f"no benchmark {args.name!r}; choose from {list(found)}")
    return subprocess.call([sys.executable, str(found[name]), *args.args])
