#!/usr/bin/env python
"""t_rs, t_ag, t_ar and their ratio for given buffer sizes; see dearopt/bench/collective.py."""

import sys

from dearopt.bench.collective import main

if __name__ == "__main__":
    sys.exit(main())
