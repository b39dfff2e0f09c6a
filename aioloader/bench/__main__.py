"""``python -m aioloader.bench``: the same as ``aioloader bench``."""

import sys

from ._cli import main

sys.exit(main())
