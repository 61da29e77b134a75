"""``python -m slabstage.demo``: the same as ``python -m slabstage demo`` in a process that already chose
``TRITON_INTERPRET`` (``python -m slabstage demo`` restarts under the interpreter when there is no GPU)."""

import sys

from .cli import main

sys.exit(main())
