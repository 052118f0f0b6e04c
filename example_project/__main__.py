"""``python -m example_project``: run the demo (see ``demo/orchestrator.py``)."""

from __future__ import annotations

import sys

from .demo.orchestrator import main

if __name__ == "__main__":
    sys.exit(main())
