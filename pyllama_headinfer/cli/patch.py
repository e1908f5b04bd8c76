"""``pyllama-headinfer patch check|apply|revert|status|export|rebase|lint``: the patch
manager (:mod:`pyllama_headinfer.patches`) on a llama.cpp tree, or with
``--series llama-cpp-python`` the second series (``patches/llama-cpp-python``)
on the Python layer of the llama-cpp-python sdist (``--llama-src``: e.g. the
tree ``build --llama-cpp-python`` leaves in ``build/<config>/llama-cpp-python/src``).

A tree given for the C series that is not a llama.cpp tree (it lacks one of
:data:`~pyllama_headinfer.source.fetch.LLAMA_CPP_KEY_FILES`) is refused with
exit 2 before any work.

``patch lint`` checks the series' shape (:mod:`pyllama_headinfer.patches.lint`):
size, churn, message, author and AI-usage disclosure of each patch."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

from pyllama_headinfer import paths, pin
from pyllama_headinfer.errors import EXIT_FAILURE, EXIT_OK, UsageError
from pyllama_headinfer.patches.apply import apply, revert
from pyllama_headinfer.patches.check import check
from pyllama_headinfer.patches.export import export
from pyllama_headinfer.patches.lint import MAX_ADDED_OUTSIDE_TESTS, lint
from pyllama_headinfer.patches.retarget import (drift, is_other_tree, pin_of_tree, pristine_files_of_pin,
                                                pristine_pin_files, rebase)
from pyllama_headinfer.patches.series import load_series
from pyllama_headinfer.patches.status import State, status
from pyllama_headinfer.series import series_dir
from pyllama_headinfer.source.fetch import LLAMA_CPP_KEY_FILES, LLAMA_SRC_ENV, locate_tree, require_llama_tree


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="patch_action", metavar="ACTION")
    actions.required = True
    helps = {
        "check": "report, per patch and per failing hunk, whether the series applies (read-only)",
        "apply": "apply the whole series (all or nothing; no-op if already applied)",
        "revert": "undo the series and verify the tree is the pristine pin",
        "status": "PRISTINE, APPLIED, PARTIAL or MODIFIED (exit 1 for the last two)",
        "export": "rewrite the series from a git checkout's commits on top of the pin",
        "rebase": "re-target the series onto another llama.cpp tree (3-way), into a new directory",
        "lint": "check that the series reads as upstream pull requests: size, churn, messages, authors "
                "(read-only; exit 1 when a patch fails)",
    }
    descriptions = {
        "lint": f"""Check that the series reads as a set of upstream pull requests, not a history. Per patch:
            its added lines outside tests/ and in them (FAIL above {MAX_ADDED_OUTSIDE_TESTS} outside tests); its
            churn, the lines it adds that a later patch removes again (FAIL on any; counted by replaying the series
            on the pin's files, checked against git apply); its message (subject and body), which must not name
            project issues (#N, issue N; upstream's are written ggml-org/llama.cpp#N, PR #N or upstream #N), the
            series as a history (this series, the previous/earlier/later/next patch|change|commit), GPU models as
            evidence (H100, A100, RTX ...), pyllama, the headinfer project or CI; its From:, a name and an email
            of a real domain (no reserved placeholder: example.com, *.example, invalid, localhost, test); and
            llama.cpp's AI-usage disclosure, a line "AI usage disclosure: YES ... / NO". One line per patch and a
            summary; exit 0 when every patch passes, 1 when one fails, 2 for bad usage.""",
    }
    for name, text in helps.items():
        sub = actions.add_parser(name, help=text, description=" ".join(descriptions.get(name, text).split()))
        if name == "lint":
            sub.add_argument("--patches-dir", metavar="DIR",
                             help=f"the series to check (default: {paths.patches_dir()}); it is replayed on the "
                                  "files of the active pin (--pin)")
            sub.add_argument("--json", action="store_true", help="print the report as JSON")
            continue
        if name == "rebase":
            sub.add_argument("--onto", metavar="TREE", required=True,
                             help=f"the llama.cpp tree to re-target to: a directory, or a pin ({', '.join(pin.PINS)}) "
                                  "for its verified cached tree")
            sub.add_argument("--out", metavar="DIR",
                             help="where the re-targeted series goes (default: patches/<pin> when --onto names a "
                                  "pin); a series already there is learned from first (see docs/PATCHES.md)")
            sub.add_argument("--patches-dir", metavar="DIR", help=f"the series to re-target (default: {paths.patches_dir()})")
            continue
        target = "the git checkout to export from" if name == "export" else "the llama.cpp tree"
        sub.add_argument("--llama-src", metavar="PATH",
                         help=f"{target} (default: the cached tree); for the C series it must hold "
                              f"{', '.join(LLAMA_CPP_KEY_FILES)}")
        sub.add_argument("--patches-dir", metavar="DIR", help=f"series directory (default: {paths.patches_dir()}, "
                         f"or {paths.python_patches_dir()} with --series {paths.PYTHON_SERIES})")
        sub.add_argument("--series", choices=SERIES, default=SERIES[0],
                         help=f"which series: {SERIES[0]} (the C series, on a llama.cpp tree; default) or "
                              f"{paths.PYTHON_SERIES} (on the Python layer of the "
                              f"{pin.PYTHON_LAYER_SDIST.requirement} sdist, given with --llama-src)")
        if name == "export":
            sub.add_argument("--base", metavar="COMMIT",
                             help="the commit the series starts from (default: the pin, or the commit with its tree)")


SERIES = ("llama.cpp", paths.PYTHON_SERIES)


def _rebase(args: argparse.Namespace) -> int:
    """``patch rebase --onto TREE|PIN [--out DIR]``: exit 0 when every patch came across (clean,
    merged, replayed or resolved from record), 1 when conflicts are left with markers."""
    source_dir = series_dir(args.patches_dir)
    with contextlib.ExitStack() as stack:
        onto = pin.PINS.get(args.onto)
        if onto is None and Path(args.onto).is_dir():
            onto = pin_of_tree(require_llama_tree(locate_tree(args.onto)))  # a pin's tree, maybe carrying its series: its pristine files
        if onto is not None:
            # its pristine files (its cached tree may carry its own series)
            tree = stack.enter_context(pristine_files_of_pin(onto, load_series(source_dir).touched))
            out = Path(args.out) if args.out else paths.patches_root() / onto.build
            target = f"llama.cpp {onto.build} ({onto.commit or 'tree ' + onto.tree})"
        else:
            tree = require_llama_tree(locate_tree(args.onto))
            if not args.out:
                raise UsageError("--out is needed when --onto is a directory (it names no pin)")
            out, target = Path(args.out), f"the llama.cpp tree {tree}"
        report = rebase(tree, out, source_dir, target=target)
    print(report.describe())
    print(f"wrote the re-targeted series to {out}")
    left = [p.name for p in report.conflicting] + [p.name + " (its message)" for p in report.messages_left]
    if left:
        print(f"to do: resolve {', '.join(left)}: apply {out}'s series to a git checkout of the tree (`git am`), fix "
              f"each commit, `patch export --llama-src CHECKOUT --patches-dir {out} --base <tree commit>`, then run "
              "this rebase again to record the resolutions")
    return EXIT_OK if report.ok else EXIT_FAILURE


def _tree(llama_src, python_layer: bool) -> Path:
    """The tree to work on; for the C series it must be a llama.cpp tree (exit 2 otherwise: see
    :func:`require_llama_tree`), the Python layer's is checked against its own listing."""
    tree = locate_tree(llama_src)
    return tree if python_layer else require_llama_tree(tree)


def run(args: argparse.Namespace) -> int:
    action = args.patch_action
    if action == "rebase":
        return _rebase(args)
    if action == "lint":
        report = lint(args.patches_dir)
        print(json.dumps(report.as_dict(), indent=1) if args.json else report.describe())
        return EXIT_OK if report.ok else EXIT_FAILURE
    python_layer = args.series == paths.PYTHON_SERIES
    patches_dir = args.patches_dir or (paths.python_patches_dir() if python_layer else None)
    pristine = pin.python_layer_files() if python_layer else None
    if python_layer and not args.llama_src:
        raise UsageError(f"--series {paths.PYTHON_SERIES} needs --llama-src: the sdist's Python layer "
                         "(e.g. build/cpu/llama-cpp-python/src after `build --llama-cpp-python`)")
    if action == "export":
        if not args.llama_src and not os.environ.get(LLAMA_SRC_ENV):
            raise UsageError("export needs --llama-src: a git checkout whose commits on top of the pin are the series")
        names = export(_tree(args.llama_src, python_layer), patches_dir, base=args.base, pristine=pristine)
        print(f"exported {len(names)} patches to {series_dir(patches_dir)}")
        return EXIT_OK
    tree = _tree(args.llama_src, python_layer)
    if action == "status":
        report = status(tree, patches_dir, pristine=pristine)
        print(f"{tree}: {report.describe()}")
        return EXIT_OK if report.state in (State.PRISTINE, State.APPLIED) else EXIT_FAILURE
    if action == "check":
        series = load_series(patches_dir)
        if not python_layer and is_other_tree(tree, series):
            with pristine_pin_files(series) as pin_files:
                drift_report = drift(tree, pin_files, series.directory)
            print(drift_report.describe())
            return EXIT_OK if drift_report.ok else EXIT_FAILURE
        report = check(tree, patches_dir, pristine=pristine)
        print(report.describe())
        return EXIT_OK if report.ok else EXIT_FAILURE
    change = (apply if action == "apply" else revert)(tree, patches_dir, pristine=pristine)
    print(change.message)
    return EXIT_OK
