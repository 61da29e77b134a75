"""``python -m slabstage demo [options]`` (also the ``slabstage`` console script): see slabstage/demo/.

Without a CUDA device the demo runs slabstage's Triton kernels under Triton's
interpreter. The kernels read ``TRITON_INTERPRET`` when they are defined, which
happens when ``slabstage`` itself is imported, before this module runs; so when
the variable is unset, triton is installed and no CUDA device is present, the
command restarts its own process once with ``TRITON_INTERPRET=1``. An explicit
``TRITON_INTERPRET=0`` is respected: the PyTorch reference path then stages, and
the demo says so.
"""

from __future__ import annotations

import importlib.util
import os
import sys

USAGE = """usage: python -m slabstage demo [--model {toy,qwen3-vl,qwen3-vl-moe,qwen2.5-vl,qwen2-vl,llama,qwen2,
                                                 qwen3}] [options]
       python -m slabstage demo --help"""


def interpreter_argv(argv: list[str]) -> list[str] | None:
    """The command line to restart with under ``TRITON_INTERPRET=1``, or None when this process will do."""
    if "TRITON_INTERPRET" in os.environ or importlib.util.find_spec("triton") is None:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return [sys.executable, "-m", "slabstage", *argv]


def main(argv: list[str] | None = None) -> int:
    """Run a command. ``argv=None`` means this process's command line: only then may it restart itself."""
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "demo":
        restart = interpreter_argv(argv) if from_command_line else None
        if restart is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os.execve(sys.executable, restart, {**os.environ, "TRITON_INTERPRET": "1"})
        from .demo import main as demo_main

        return demo_main(argv[1:])
    print(f"unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
