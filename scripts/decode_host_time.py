#!/usr/bin/env python3
"""How long one decode step holds the host under the HeadInfer split.

    python scripts/decode_host_time.py --model M.gguf [--depth 32768] [--fracs 1,0.5,0.25] [--steps 32]
                                       [--attn chunked [--attn-chunk N]]

For each fraction a context is filled to
``--depth`` tokens, two steps are decoded to warm up (their times are the
last column: the first steps of a new graph, e.g. CUDA graphs captured
again, which a short benchmark such as llama-bench's tg16 counts), then ``--steps``
single-token steps are timed twice over: until ``llama_decode`` returns (the
host's part: building or reusing the graph, queuing its work, and whatever
the host waits for) and until ``llama_synchronize`` returns (the device is
done). A step whose ``llama_decode`` returns well before the device is done
leaves the host free, e.g. for the next step's sampling while the device
finishes. Medians in milliseconds; wall-clock figures, for comparing the
configurations of one run on one machine (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pyllama_headinfer.llama import Context, Model  # noqa: E402


def time_steps(ctx: Context, n_steps: int) -> tuple[list[float], list[float]]:
    """Milliseconds of each step until llama_decode returns, and until the device is done."""
    host, total = [], []
    for i in range(n_steps):
        t0 = time.perf_counter()
        ctx.decode([1 + i % (ctx.model.n_vocab - 1)])
        t1 = time.perf_counter()
        ctx.synchronize()
        t2 = time.perf_counter()
        host.append(1e3 * (t1 - t0))
        total.append(1e3 * (t2 - t0))
    return host, total


def main(argv: list[str] | None = None) -> int:
    from gpu_check import add_attn_arguments, filled_context  # the exactness check's --attn, --attn-chunk

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "-m", required=True)
    parser.add_argument("--depth", type=int, default=32768)
    parser.add_argument("--fracs", default="1,0.5,0.25")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--ngl", type=int, default=99)
    parser.add_argument("--type", default="f16", help="KV cache type")
    add_attn_arguments(parser)
    args = parser.parse_args(argv)

    fracs = [float(f) for f in args.fracs.split(",")]

    print(f"depth {args.depth}, {args.steps} steps, KV {args.type}, attention {args.attn}"
          f"{f' in chunks of {args.attn_chunk}' if args.attn_chunk else ''}; medians in ms")
    print("| frac | llama_decode returns | device done | host share | 1st, 2nd step after the fill |")
    print("|---|---|---|---|---|")
    with Model(args.model, n_gpu_layers=args.ngl) as model:
        for frac in fracs:
            with filled_context(model, args.depth, 2 + args.steps, args, frac) as ctx:
                # the first steps after the fill: a new graph (e.g. CUDA graphs captured again), not in the medians
                _, first = time_steps(ctx, 2)
                host_steps, total_steps = time_steps(ctx, args.steps)
            host, total = statistics.median(host_steps), statistics.median(total_steps)
            print(f"| {frac:g} | {host:.2f} | {total:.2f} | {host / total:.0%} | {first[0]:.2f}, {first[1]:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
