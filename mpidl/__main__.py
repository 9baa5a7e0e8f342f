"""``python -m mpidl`` is the ``mpidl`` command."""

import sys

from .cli import main

sys.exit(main())
