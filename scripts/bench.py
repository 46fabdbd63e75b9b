#!/usr/bin/env python
"""DDP vs dearopt schedules with measured parts and bounds; see dearopt/bench/__main__.py (python -m dearopt.bench)."""

import sys

from dearopt.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
