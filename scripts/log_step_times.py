#!/usr/bin/env python3
"""Decoding step times from a verbose llama.cpp log on CUDA, without a profiler.

    python3 scripts/log_step_times.py LOG     # e.g. llama-batched-bench -v ... 2> LOG

With ``-v``, ggml-cuda logs ``CUDA Graph id N reused`` each time a split's
CUDA graph is replayed, and llama.cpp's log stamps every line (minutes,
seconds, milliseconds, microseconds since the start). A decoding step whose
graph is reused replays the splits' graphs in the same order each step: a
graph id that is not larger than the one before starts a new step. The time
from one step's first replay to the next one's is that step's time on the
host, which, for a step bound by its copies, is the device's (the host queues
a split's copies one or two splits ahead). Prints the steps' times, their
median and mean; a spread between steps of the same bytes is the machine's
(e.g. its host-to-device copy rate), not the graph's.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

_STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")
_REUSED = re.compile(r"CUDA Graph id (\d+) reused")


def step_starts(lines) -> list[float]:
    """Seconds at which each step with reused CUDA graphs starts."""
    starts, prev = [], None
    for line in lines:
        reused = _REUSED.search(line)
        stamp = _STAMP.match(line)
        if not (reused and stamp):
            continue
        m, s, ms, us = (int(x) for x in stamp.groups())
        uid = int(reused.group(1))
        if prev is None or uid <= prev:
            starts.append(60 * m + s + ms / 1e3 + us / 1e6)
        prev = uid
    return starts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    args = parser.parse_args(argv)
    try:
        with open(args.log, errors="replace") as f:
            starts = step_starts(f)
    except OSError as e:
        print(f"{args.log}: {e.strerror}", file=sys.stderr)
        return 2
    times = [1e3 * (b - a) for a, b in zip(starts, starts[1:])]
    if not times:
        print(f"{args.log}: fewer than two steps with reused CUDA graphs (was the log written with -v?)",
              file=sys.stderr)
        return 1
    print(f"{len(times)} steps (ms): {' '.join(f'{t:.1f}' for t in times)}")
    print(f"median {statistics.median(times):.1f} ms, mean {statistics.mean(times):.1f} ms, "
          f"min {min(times):.1f}, max {max(times):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
