"""The ``pyllama-headinfer`` command line: ``main(argv) -> exit status``.

Each subcommand is a module of this package with ``add_arguments(parser)``
and ``run(args) -> int``; only the module of the command being run is
imported, so ``--help`` stays fast.

This is the one place that turns exceptions into messages and exit codes,
the same for every command (README, "Exit codes"):

- 0: success;
- 1: the operation failed -- a :class:`HeadInferError` (printed as
  ``error: <message>``), or a command's own "no" (``patch status`` of a
  modified tree, ``plan`` when nothing fits, ``bench`` with unmeasured points);
- 2: bad usage or input -- argparse's errors, a :class:`UsageError`, a
  ``ValueError`` from checking an argument, a missing model file;
- 130: interrupted (Ctrl-C).

While a command runs, the package's progress goes to stderr through
``logging``, llama.cpp's own log is shown from WARNING up (all of it with
``-v``; an ERROR line that an exception quotes is not shown twice) and
warnings are one ``warning: ...`` line; all of it is put back afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import warnings
from typing import List, NamedTuple, Optional, Sequence, Tuple

from pyllama_headinfer import __version__, pin
from pyllama_headinfer.errors import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, BuildInterrupted, HeadInferError,
                                      UsageError)
from pyllama_headinfer.runtime.log import CAPTURED_ATTR


class Subcommand(NamedTuple):
    name: str
    module: str
    help: str


SUBCOMMANDS: Sequence[Subcommand] = (
    Subcommand("source", "pyllama_headinfer.cli.source", "fetch, verify or locate the pinned llama.cpp source"),
    Subcommand("patch", "pyllama_headinfer.cli.patch", "check, apply, revert, inspect, export, re-target or lint the patch series"),
    Subcommand("build", "pyllama_headinfer.cli.build", "configure and compile the patched llama.cpp"),
    Subcommand("generate", "pyllama_headinfer.cli.generate", "generate text with HeadInfer"),
    Subcommand("plan", "pyllama_headinfer.cli.plan", "choose the head fraction from a VRAM budget (no weights loaded)"),
    Subcommand("bench", "pyllama_headinfer.cli.bench", "measure speed and KV memory over frac x depth x KV type"),
    Subcommand("serve", "pyllama_headinfer.cli.serve", "run the patched llama-server (OpenAI API) with HeadInfer"),
)

# llama.cpp's own log (see pyllama_headinfer.runtime.log) is chatty at INFO
LLAMA_LOGGER = "pyllama_headinfer.llama"


class CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (pytest swaps it)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


class Formatter(logging.Formatter):
    """INFO as the bare message, other levels prefixed (``warning: ...``)."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno == logging.INFO:
            return message
        return f"{record.levelname.lower()}: {message}"


@contextlib.contextmanager
def cli_logging(verbose: bool):
    """Progress to stderr while a command runs; the package logger and
    llama.cpp's are put back as they were afterwards, so main() called from
    Python (or tests) leaves no global logging state behind."""
    package = logging.getLogger("pyllama_headinfer")
    llama = logging.getLogger(LLAMA_LOGGER)
    saved = (package.level, package.propagate, llama.level)
    handler = CurrentStderr()
    handler.setFormatter(Formatter("%(message)s"))
    if not verbose:
        # llama.cpp's errors inside an API call are quoted by the exception the call raises, which is
        # printed as `error: ...`: once is enough (warnings still show, they may not end in an exception)
        handler.addFilter(lambda record: not (record.levelno >= logging.ERROR
                                              and getattr(record, CAPTURED_ATTR, False)))
    package.addHandler(handler)
    package.setLevel(logging.DEBUG if verbose else logging.INFO)
    package.propagate = False  # no second copy through handlers of the root logger
    llama.setLevel(logging.NOTSET if verbose else logging.WARNING)
    shown = warnings.showwarning

    def show_warning(message, category, filename, lineno, file=None, line=None):  # one line, no source location
        print(f"warning: {message}", file=sys.stderr)

    warnings.showwarning = show_warning
    try:
        yield
    finally:
        warnings.showwarning = shown
        package.removeHandler(handler)
        package.level, package.propagate, llama.level = saved


def take_pin_option(argv: Sequence[str]) -> Tuple[Optional[str], List[str]]:
    """``--pin BUILD`` / ``--pin=BUILD`` taken out of the arguments wherever it stands (before a
    ``--``), so that ``source fetch --pin b11549`` works like ``--pin b11549 source fetch``."""
    build, rest = None, []
    words = iter(argv)
    for word in words:
        if word == "--":
            rest.append(word)
            rest.extend(words)
            break
        if word == "--pin":
            build = next(words, None)
            if build is None:
                raise UsageError("--pin needs a build, e.g. --pin " + pin.DEFAULT_PIN)
        elif word.startswith("--pin="):
            build = word[len("--pin="):]
            if not build:
                raise UsageError("--pin= needs a build, e.g. --pin " + pin.DEFAULT_PIN)
        else:
            rest.append(word)
    return build, rest


def chosen_command(argv: Sequence[str]) -> Optional[str]:
    """The first word that is not an option (top-level options take no value)."""
    for word in argv:
        if word == "--":
            return None
        if not word.startswith("-"):
            return word
    return None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser; only the chosen command's module is imported to add its arguments."""
    default = pin.PINS.get(os.environ.get(pin.PIN_ENV) or pin.DEFAULT_PIN, pin.PINS[pin.DEFAULT_PIN])
    parser = argparse.ArgumentParser(
        prog="pyllama-headinfer",
        allow_abbrev=False,  # --pin is taken out before argparse: an abbreviation of it must not pass unnoticed
        description=f"HeadInfer for llama.cpp {default.short} (pins: {', '.join(pin.PINS)}).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debugging details to stderr")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__} (llama.cpp {default.build})")
    pin_help = (f"which llama.cpp pin to work on: {', '.join(pin.PINS)} (default: ${pin.PIN_ENV}, else "
                f"{pin.DEFAULT_PIN}); each has its own source tree, patch series and build directories")
    parser.add_argument("--pin", metavar="BUILD", help=pin_help + "; may be given after the command too")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = chosen_command(argv)
    for subcommand in SUBCOMMANDS:
        sub = commands.add_parser(subcommand.name, help=subcommand.help, description=subcommand.help)
        sub.set_defaults(module=subcommand.module)
        if subcommand.name == chosen:
            importlib.import_module(subcommand.module).add_arguments(sub)
    return parser


def exit_status(exc: BaseException) -> int:
    """The exit status for an exception a command raised (see the module docstring)."""
    if isinstance(exc, (KeyboardInterrupt, BuildInterrupted)):
        return EXIT_INTERRUPTED
    if isinstance(exc, UsageError):
        return EXIT_USAGE
    if isinstance(exc, HeadInferError):
        return EXIT_FAILURE
    return EXIT_USAGE  # ValueError, FileNotFoundError, IsADirectoryError: the input is wrong


def main(argv: Optional[List[str]] = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        pin_build, arguments = take_pin_option(arguments)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        parser = build_parser(arguments)
        args = parser.parse_args(arguments)
    except SystemExit as exit_:  # argparse: --help/--version (0) or a usage error (2)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if not args.command:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    with cli_logging(args.verbose), pin.using(pin_build):
        try:
            pin.active()  # an unknown $PYLLAMA_HEADINFER_PIN is a usage error before anything runs
            return int(importlib.import_module(args.module).run(args))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except BuildInterrupted as exc:
            print(f"\n{exc}", file=sys.stderr)
            return EXIT_INTERRUPTED
        except (HeadInferError, ValueError, FileNotFoundError, IsADirectoryError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exit_status(exc)
