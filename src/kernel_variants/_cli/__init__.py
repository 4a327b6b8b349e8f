"""The ``kv`` command line: one argparse subcommand per module, each with ``add_arguments`` and
``run(args) -> int``.

``main(argv)`` is what tests call; ``entry()`` is the console script. Only the command being run
is imported, so ``kv --help`` and ``kv --version`` answer without importing torch. A mistake in the user's
input (a bad option, a missing or malformed file, an unknown variant) prints one line,
``kv <command>: error: ...``, on stderr and returns 2 (``KV_DEBUG=1`` shows the traceback
instead); a command that ran but whose verdict is
negative (a failing ``kv gate``) returns 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import NoReturn

from kernel_variants import __version__

# command -> (module in this package, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "list": ("list_", "registered variants, or the decision for one shape"),
    "build": ("build", "compile the variants built on this machine now (for images and CI)"),
    "qualify": ("qualify", "check variants against the reference on the op's edge cases, on this device"),
    "calibrate": ("calibrate", "measure variants on a sweep and store each shape's winner"),
    "table": ("table", "calibrated winners per shape, with every variant's time"),
    "compare": ("compare", "head-to-head of two variants (or two CSV columns), per shape"),
    "gate": ("gate", "exit 1 if the candidate is slower than the incumbent beyond the tolerance anywhere"),
    "export": ("export", "write this device's table as a JSON document"),
    "import": ("import_", "merge a table document into this machine's table"),
    "info": ("info", "device fingerprint, cache location, table size, plugins"),
    "shadow": ("shadow", "what shadow verification of live calls found (KV_SHADOW), and replays"),
}


class UsageError(Exception):
    """An argparse complaint, raised instead of argparse's print-usage-and-exit."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message}")


def build_parser(load: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``kv`` parser; the commands in ``load`` (default: all) get their full options, the
    others only their name and help line, which is all that ``kv --help`` shows."""
    parser = _Parser(prog="kv", description="Inspect, calibrate and compare kernel variants.")
    parser.add_argument("--version", action="version", version=f"kernel-variants {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module, help_line) in COMMANDS.items():
        if load is not None and name not in load:
            sub.add_parser(name, help=help_line)
            continue
        mod = importlib.import_module(f"{__name__}.{module}")
        p = sub.add_parser(name, help=help_line, description=(mod.__doc__ or "").replace("``", ""),
                           parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(run=mod.run)
    return parser


def describe(exc: BaseException) -> str:
    """One line for a user error, whatever shape its message has."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": str(exc)}
        where = ".".join(str(p) for p in first["loc"])
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        return f"{exc.title}: {where + ': ' if where else ''}{first['msg']}{more}"
    if isinstance(exc, KeyError) and exc.args:
        text = str(exc.args[0])
    elif isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    elif isinstance(exc, json.JSONDecodeError):
        text = f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    else:
        text = str(exc) or type(exc).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def _warning_line(command: str):
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"kv {command}: warning: {message}", file=file or sys.stderr)

    return show


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``kv`` command; returns its exit status (0 ok, 1 negative verdict, 2 user error,
    3 internal error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(load=[a for a in argv if a in COMMANDS][:1])
    try:
        args, extra = parser.parse_known_args(argv)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help and --version print, then exit 0
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if extra:
        print(f"kv {args.command}: error: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        # Filters stay as the caller set them; only the display becomes one line per warning.
        warnings.showwarning = _warning_line(args.command)
        try:
            return args.run(args)
        except BrokenPipeError:
            # The reader (head, less) went away: not an error worth a line. Later writes at exit
            # would raise again, so stdout is pointed at /dev/null.
            _silence_stdout()
            return 0
        except (ValueError, TypeError, KeyError, OSError, UsageError) as exc:
            if os.environ.get("KV_DEBUG"):  # a bug can raise these too: show where
                raise
            print(f"kv {args.command}: error: {describe(exc)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"\nkv {args.command}: interrupted", file=sys.stderr)
            return 130
        except Exception:
            # A bug, not a user mistake: show where, and exit with a status no verdict uses, so
            # that CI running `kv gate` can tell a crash (3) from a regression (1).
            traceback.print_exc()
            print(f"kv {args.command}: internal error (please report it with the traceback above)", file=sys.stderr)
            return 3


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (tests)
        pass


def entry() -> None:
    sys.exit(main())
