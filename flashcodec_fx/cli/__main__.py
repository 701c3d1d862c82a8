"""``python -m flashcodec_fx.cli``: the ``flashcodec`` command without the console script."""

import sys

from . import main

sys.exit(main())
