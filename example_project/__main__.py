"""``python -m example_project``: run the demo (see ``demo.py``)."""

from __future__ import annotations

import sys

from .demo import main

if __name__ == "__main__":
    sys.exit(main())
