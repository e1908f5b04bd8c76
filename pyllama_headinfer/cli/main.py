"""The ``pyllama-headinfer`` command line.

Subcommands are plugged in through :data:`SUBCOMMANDS`: each names a module
with ``add_arguments(parser)`` and ``run(args) -> int``. Only the module of
the command being run is imported, so ``--help`` stays fast and a module that
does not exist yet simply does not show up.

Exit codes: 0 success, 1 an expected failure (a :class:`HeadInferError`,
printed as ``error: <message>``), 2 a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import sys
from typing import List, NamedTuple, Optional, Sequence

from pyllama_headinfer import __version__, pin
from pyllama_headinfer.errors import HeadInferError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class Subcommand(NamedTuple):
    name: str
    module: str
    help: str


# One line per subcommand; a module that is not there yet is skipped.
SUBCOMMANDS: Sequence[Subcommand] = (
    Subcommand("source", "pyllama_headinfer.source", "fetch, verify or locate the pinned llama.cpp source"),
    Subcommand("patch", "pyllama_headinfer.patches", "check, apply, revert, inspect or export the patch series"),
    Subcommand("build", "pyllama_headinfer.build", "configure and compile the patched llama.cpp"),
    Subcommand("generate", "pyllama_headinfer.generate_cli", "generate text with HeadInfer"),
    Subcommand("plan", "pyllama_headinfer.plan_cli", "choose the head fraction from a VRAM budget (no weights loaded)"),
    Subcommand("bench", "pyllama_headinfer.bench_cli", "measure speed and KV memory over frac x depth x KV type"),
)


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (pytest swaps it)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno == logging.INFO:
            return message
        return f"{record.levelname.lower()}: {message}"


@contextlib.contextmanager
def _cli_logging(verbose: bool):
    """Progress to stderr while a command runs; the package logger is put
    back as it was afterwards, so main() called from Python (or tests) leaves
    no global logging state behind."""
    logger = logging.getLogger("pyllama_headinfer")
    saved = (logger.level, logger.propagate)
    handler = _CurrentStderr()
    handler.setFormatter(_Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False  # no second copy through handlers of the root logger
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.level, logger.propagate = saved


def _available(subcommand: Subcommand) -> bool:
    try:
        return importlib.util.find_spec(subcommand.module) is not None
    except ImportError:
        return False


def _chosen_command(argv: Sequence[str]) -> Optional[str]:
    """The first word that is not an option (top-level options take no value)."""
    for word in argv:
        if word == "--":
            return None
        if not word.startswith("-"):
            return word
    return None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser; only the chosen command's module is imported to add its arguments."""
    parser = argparse.ArgumentParser(
        prog="pyllama-headinfer",
        description=f"HeadInfer for llama.cpp {pin.LLAMA_CPP_BUILD} ({pin.LLAMA_CPP_COMMIT[:12]}).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debugging details to stderr")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__} (llama.cpp {pin.LLAMA_CPP_BUILD})")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _chosen_command(argv)
    for subcommand in SUBCOMMANDS:
        if not _available(subcommand):
            continue
        sub = commands.add_parser(subcommand.name, help=subcommand.help, description=subcommand.help)
        sub.set_defaults(_module=subcommand.module)
        if subcommand.name == chosen:
            _load(subcommand.module).add_arguments(sub)
    return parser


def _load(module_name: str):
    return importlib.import_module(module_name)


def main(argv: Optional[List[str]] = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(arguments)
        args = parser.parse_args(arguments)
    except SystemExit as exit_:  # argparse: --help/--version (0) or a usage error (2)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    except ImportError as exc:  # a plugged-in command whose module cannot load
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if not args.command:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    with _cli_logging(args.verbose):
        try:
            return int(_load(args._module).run(args))
        except HeadInferError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
