"""``python -m autopp ...``: the ``autopp`` command line."""

import sys

from autopp._cli import main

sys.exit(main())
