"""``pyllama-headinfer source fetch|verify|path``: the pinned llama.cpp
source (:mod:`pyllama_headinfer.source`). A tree counts as usable when it is
the pin, pristine or with exactly our patch series applied."""

from __future__ import annotations

import argparse

from pyllama_headinfer.errors import EXIT_FAILURE, EXIT_OK
from pyllama_headinfer.patches.status import tree_acceptance
from pyllama_headinfer.source.fetch import ensure_source, fetch_source, locate_tree


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="source_action", metavar="ACTION")
    actions.required = True
    fetch = actions.add_parser("fetch", help="download and verify the pinned llama.cpp into the cache")
    fetch.add_argument("--force", action="store_true", help="re-download even if a cached tree exists")
    verify = actions.add_parser("verify", help="check a tree against the pinned commit")
    path = actions.add_parser("path", help="print the path of a verified tree (fetching it if needed)")
    for sub in (verify, path):
        sub.add_argument("--llama-src", metavar="PATH", help="llama.cpp tree (default: the cached one)")
    path.add_argument("--allow-unverified", action="store_true", help="accept a tree that is not the pin")


def run(args: argparse.Namespace) -> int:
    if args.source_action == "fetch":
        print(fetch_source(force=args.force, accept=tree_acceptance))
        return EXIT_OK
    if args.source_action == "path":
        print(ensure_source(args.llama_src, allow_unverified=args.allow_unverified, accept=tree_acceptance))
        return EXIT_OK
    tree = locate_tree(args.llama_src)
    usable, description = tree_acceptance(tree)
    print(f"{tree}: {description}")
    return EXIT_OK if usable else EXIT_FAILURE
