"""Run the benchmark suites here, each suite's JSON to bench/results: ``python bench/run.py --help``."""

import sys

from harness.run import main

if __name__ == "__main__":
    sys.exit(main())
