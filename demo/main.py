"""The main job as a script: ``python demo/main.py [ARGS]`` is ``flashcodec run [ARGS]`` (``flashcodec run --help``)."""

import sys

from flashcodec_fx.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
