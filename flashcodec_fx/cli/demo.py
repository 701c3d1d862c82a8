"""``flashcodec demo [ARGS...]``: the Gradio app of a source checkout (``demo/app.py``), ARGS passed to its
``main(argv)``. Needs the ``[demo]`` extra (gradio); without it, one line says how to get it."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from .errors import CLIError

APP = Path(__file__).resolve().parents[2] / "demo" / "app.py"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="the Gradio app (needs the [demo] extra)", description=__doc__)
    parser.add_argument("args", nargs="*", metavar="ARGS", help="arguments for the app (flashcodec demo -- --help: its help)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("gradio") is None:
        raise CLIError("the demo needs gradio: pip install -e '.[demo]' (from a source checkout)")
    if not APP.is_file():
        raise CLIError(f"no demo app at {APP}: the demo comes with a source checkout")
    spec = importlib.util.spec_from_file_location("flashcodec_demo_app", APP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    status = module.main(args.args)
    return 0 if status is None else int(status)
