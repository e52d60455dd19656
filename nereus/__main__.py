"""``python -m nereus ...``: the ``nereus`` command (``nereus.cli:main``), with its exit codes."""

from __future__ import annotations

import sys

from nereus.cli import main

if __name__ == "__main__":
    sys.exit(main())
