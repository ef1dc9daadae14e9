"""Entry point of the ``moeplan`` console script."""

from __future__ import annotations

import os
import signal
import sys

# Idle OpenMP threads busy-wait by default; on a small shared CPU that made profiling the
# example model ~10x slower. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import typer  # noqa: E402

# Importing the command modules registers their commands on the apps.
from planner.cli import export as _export  # noqa: F401
from planner.cli import fit as _fit  # noqa: F401
from planner.cli import profile as _profile  # noqa: F401
from planner.cli import solve as _solve  # noqa: F401
from planner.cli import trace as _trace  # noqa: F401
from planner.cli.app import app
from planner.errors import MoeplanError

try:  # recent typer vendors its own copy of click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer
    from click.exceptions import (  # type: ignore[assignment]
        ClickException,
        NoArgsIsHelpError,
        UsageError,
    )

# Library exceptions -> one line, and the exit code. Anything not listed is a bug and keeps
# its traceback. OSError covers what the machine refuses (a read-only or full disk, a name
# too long, a missing file): the write was to a temporary name, so nothing is half-written.
_USER_ERRORS: tuple[type[BaseException], ...] = (MoeplanError, OSError)
_INTERRUPTED = (
    "moeplan: {what}; no output was half-written (a stopped profile run keeps its finished "
    "parts: --resume continues it)"
)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that temporary files and child solvers are
    cleaned up on the way out (the default action kills the process where it stands)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    try:
        result = app(args=argv, prog_name="moeplan", standalone_mode=False)
    except NoArgsIsHelpError as e:  # `moeplan`, `moeplan trace`: the help, as it reads
        print(e.ctx.get_help() if e.ctx is not None else e.format_message(), file=sys.stderr)
        return e.exit_code
    except UsageError as e:  # a missing argument, an unparsable value: one line, as below
        where = e.ctx.command_path if e.ctx is not None else "moeplan"
        msg = " ".join(e.format_message().split())
        print(f"moeplan: error: {msg} (see {where} --help)", file=sys.stderr)
        return e.exit_code
    except ClickException as e:
        e.show()
        return e.exit_code
    except typer.Abort:
        print("moeplan: aborted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(_INTERRUPTED.format(what="interrupted"), file=sys.stderr)
        return 130
    except Terminated:
        print(_INTERRUPTED.format(what="terminated"), file=sys.stderr)
        return 143
    except MemoryError as e:  # sizes a user asked for (a vocabulary, a layer count) too large
        msg = str(e).splitlines()[0] if str(e) else "the allocation failed"
        print(
            f"moeplan: error: not enough memory ({msg}); use smaller sizes or a machine with "
            "more memory",
            file=sys.stderr,
        )
        return 2
    except _USER_ERRORS as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"moeplan: error: {msg}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    if result == 130:  # typer turns Ctrl-C in a command into Exit(130), returned here
        print(_INTERRUPTED.format(what="interrupted"), file=sys.stderr)
    return result if isinstance(result, int) else 0


def run() -> None:
    signal.signal(signal.SIGTERM, _raise_terminated)
    # a path the terminal's encoding cannot show (PYTHONIOENCODING=ascii, a C locale) is
    # escaped: it was a UnicodeEncodeError traceback after the work had succeeded
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    sys.exit(main())


if __name__ == "__main__":
    run()
