"""Markdown tables and plots from bench/results' JSON: ``python bench/report.py --help``."""

import sys

from harness.report import main

if __name__ == "__main__":
    sys.exit(main())
