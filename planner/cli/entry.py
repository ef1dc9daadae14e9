"""The ``moeplan`` console script.

Loading the command line imports torch, scipy and the solvers (about a second); Ctrl-C in
that second would end the run with the interpreter's traceback. Here it ends with one line,
like Ctrl-C during a command (:func:`planner.cli.main.main`).
"""

from __future__ import annotations

import sys


def run() -> None:
    try:
        from planner.cli.main import run as run_command
    except KeyboardInterrupt:
        print("moeplan: interrupted while starting; nothing was written", file=sys.stderr)
        sys.exit(130)
    run_command()
