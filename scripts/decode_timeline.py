#!/usr/bin/env python3
"""Where a decoding step's time goes on the GPU: the copy engine's busy and idle time, from a CUDA trace.

    python3 scripts/decode_timeline.py --model M.gguf --depth 32768 --frac 0.75 [--attn chunked] [--steps 8]
                                       [--trace OUT.json.gz]

The GPU machine has no Nsight Systems, but it has PyTorch, whose profiler
records every kernel and copy of the process through CUPTI, llama.cpp's
included. A context is filled to ``--depth`` tokens and warmed up, then
``--steps`` single-token steps are decoded (each waited for with
``llama_synchronize``) under the profiler; a tiny PyTorch kernel on a stream
of its own marks where each step starts. Per step:
its time, how long host-to-device copies kept the copy engine busy (their
union) against the bytes at the machine's rate, and the copy engine's idle
gaps longer than ``--gap-us``, each with its offset in the step and the
kernels that ran meanwhile. A streamed step at long context should be one
unbroken run of copies; what breaks it is what the split loses against the
link. ``--trace`` keeps the whole trace (Chrome's format) for a closer look.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pyllama_headinfer.llama import Model  # noqa: E402

MARKER_KERNEL = "FillFunctor"  # PyTorch's fill_, the step marker (main)


def gpu_events(events: list[dict]) -> list[dict]:
    """The trace's kernels, copies and memsets, by start time."""
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])


def is_marker(event: dict) -> bool:
    return event["cat"] == "kernel" and MARKER_KERNEL in event["name"]


def copy_bytes(event: dict) -> int:
    return event.get("args", {}).get("bytes", 0)


def busy_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged [start, end) intervals, sorted."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def summarize(events: list[dict], gap_us: float, top: int = 3) -> list[str]:
    """The report's lines, from the trace's GPU events (microseconds)."""
    gpu = gpu_events(events)
    markers = [e["ts"] for e in gpu if is_marker(e)]
    if len(markers) < 2:
        return [f"{len(markers)} step markers in the trace: nothing to report ({len(gpu)} GPU events)"]
    h2d = [e for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]]
    kernels = [e for e in gpu if e["cat"] == "kernel" and not is_marker(e)]
    busy_all = busy_union([(e["ts"], e["ts"] + e["dur"]) for e in h2d])
    lines = [f"| step | ms | H2D busy ms | H2D MB | idle > {gap_us:g} us: count, ms | largest (at ms: kernels meanwhile) |",
             "|---|---|---|---|---|---|"]
    totals = collections.Counter()
    idle_by_tenth = [0.0] * 10  # ms, summed over the steps: where in the step the idle time falls
    for i, (t0, t1) in enumerate(zip(markers, markers[1:])):
        busy = [(max(a, t0), min(b, t1)) for a, b in busy_all if b > t0 and a < t1]
        busy_us = sum(b - a for a, b in busy)
        mbytes = sum(copy_bytes(e) for e in h2d if t0 <= e["ts"] < t1) / 1e6
        edges = [t0] + [x for ab in busy for x in ab] + [t1]
        gaps = [(a, b) for a, b in zip(edges[0::2], edges[1::2]) if b - a > gap_us]
        gap_ms = sum(b - a for a, b in gaps) / 1e3
        largest = max(gaps, key=lambda g: g[1] - g[0], default=None)
        where = ""
        if largest:
            names = collections.Counter(e["name"][:48] for e in kernels
                                        if e["ts"] < largest[1] and e["ts"] + e["dur"] > largest[0])
            where = f"{(largest[1] - largest[0]) / 1e3:.3f} (at {(largest[0] - t0) / 1e3:.2f}: " + \
                (", ".join(f"{n} x{c}" for n, c in names.most_common(top)) or "no kernel") + ")"
        lines.append(f"| {i} | {(t1 - t0) / 1e3:.3f} | {busy_us / 1e3:.3f} | {mbytes:.1f} | {len(gaps)}, {gap_ms:.3f} "
                     f"| {where} |")
        totals.update(step=(t1 - t0) / 1e3, busy=busy_us / 1e3, gaps=gap_ms, n=1)
        for a, b in gaps:
            idle_by_tenth[min(9, int(10 * (a - t0) / (t1 - t0)))] += (b - a) / 1e3
    n = totals["n"]
    inner = [e for e in h2d if markers[0] <= e["ts"] < markers[-1]]
    if inner:
        between = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(inner, inner[1:])]
        size_mb = statistics.median(copy_bytes(e) for e in inner) / 1e6
        rate = statistics.median(copy_bytes(e) / e["dur"] / 1e3 for e in inner if e["dur"] > 0)
        lines.append(f"host-to-device copies: {len(inner) / n:.0f} per step, median {size_mb:.2f} MB, "
                     f"median rate within a copy {rate:.2f} GB/s, "
                     f"from the end of one to the start of the next: median {statistics.median(between):.1f} us, "
                     f"{sum(max(0.0, g) for g in between if g <= gap_us) / n / 1e3:.3f} ms per step in gaps <= {gap_us:g} us")
    lines.append(f"mean over {n} steps: step {totals['step'] / n:.3f} ms, copies busy {totals['busy'] / n:.3f} ms "
                 f"({totals['busy'] / totals['step']:.1%}), idle gaps {totals['gaps'] / n:.3f} ms; idle ms per step by "
                 "tenth of the step: " + " ".join(f"{ms / n:.3f}" for ms in idle_by_tenth))
    return lines


def detail(events: list[dict], step: int, edge_ms: float) -> list[str]:
    """Every GPU event of one step within edge_ms of its start or its end: offset, duration, stream, name, bytes."""
    gpu = gpu_events(events)
    markers = [e["ts"] for e in gpu if is_marker(e)]
    if step + 1 >= len(markers):
        return [f"no step {step}"]
    t0, t1 = markers[step], markers[step + 1]
    lines = [f"step {step} ({(t1 - t0) / 1e3:.3f} ms): events within {edge_ms:g} ms of its start or end "
             "(offset ms, duration us, stream, name, bytes)"]
    for e in gpu:
        end = e["ts"] + e["dur"]
        if (t0 - 1e3 * edge_ms <= e["ts"] <= t0 + 1e3 * edge_ms or t1 - 1e3 * edge_ms <= end <= t1 + 1e3 * edge_ms):
            lines.append(f"{(e['ts'] - t0) / 1e3:9.3f} {e['dur']:8.1f} s{e.get('args', {}).get('stream', '?'):<3} "
                         f"{e['name'][:60]} {e.get('args', {}).get('bytes', '')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    from gpu_check import add_attn_arguments, filled_context

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "-m", required=True)
    parser.add_argument("--depth", type=int, default=32768)
    parser.add_argument("--frac", type=float, default=0.75)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--type", default="f16", help="KV cache type")
    parser.add_argument("--gap-us", type=float, default=20.0)
    parser.add_argument("--trace", help="write the whole trace here (gzipped Chrome trace)")
    parser.add_argument("--detail", type=int, default=-1, metavar="STEP",
                        help="also list the events of this step within --edge-ms of its start and end")
    parser.add_argument("--edge-ms", type=float, default=1.0)
    add_attn_arguments(parser)
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    marker = torch.zeros(1, device="cuda")
    # the marker's own stream, waited for alone: torch.cuda.synchronize() waits for every stream of the device,
    # llama.cpp's prefetch of the next step included, and would hold the host back where llama_synchronize does not
    marker_stream = torch.cuda.Stream()
    with Model(args.model, n_gpu_layers=99) as model, \
            filled_context(model, args.depth, 3 + args.steps, args, args.frac) as ctx:
        for i in range(3):
            ctx.decode([1 + i]); ctx.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(args.steps + 1):
                with torch.cuda.stream(marker_stream):
                    marker.fill_(i)  # a kernel on a stream of its own: where the step starts
                marker_stream.synchronize()
                if i < args.steps:
                    ctx.decode([1 + i % (model.n_vocab - 1)])
                    ctx.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            text = Path(path).read_text()
    events = json.loads(text)["traceEvents"]
    if args.trace:
        with gzip.open(args.trace, "wt") as f:
            f.write(text)
    print(f"depth {args.depth}, frac {args.frac:g}, KV {args.type}, attention {args.attn}"
          f"{f' in chunks of {args.attn_chunk}' if args.attn_chunk else ''}, {args.steps} steps")
    for line in summarize(events, args.gap_us):
        print(line)
    if args.detail >= 0:
        for line in detail(events, args.detail, args.edge_ms):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
