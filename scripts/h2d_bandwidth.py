#!/usr/bin/env python3
"""Host-to-device copy rate from pinned memory on this machine's GPU (PyTorch), in copies of the sizes the split
streams: one layer's host K or V at 32K cells and f 0.75 is 16 MiB. The ratios in docs/BENCHMARKS.md use 55.4 GB/s
(FACTS); this says what the machine at hand gives, in the same call as the benchmark it qualifies, and how much it
varies: 1 GiB in copies of 16 MiB timed 100 times over a few seconds (min, median, max, and how many of the 100 were
slower than 95 % of the median: a machine with such dips slows some decoding steps, not all).

  python3 scripts/h2d_bandwidth.py     # on the GPU machine (its image has PyTorch)
"""
import torch

n = 1 << 30
h = torch.empty(n, dtype=torch.uint8).pin_memory()
d = torch.empty(n, dtype=torch.uint8, device="cuda")
s = torch.cuda.Stream()


def rate(chunk: int) -> float:
    """GB/s of one copy of the n bytes in copies of chunk bytes, queued on s and timed by its events."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(s):
        e0.record(s)
        for o in range(0, n, chunk):
            d[o:o + chunk].copy_(h[o:o + chunk], non_blocking=True)
        e1.record(s)
    e1.synchronize()
    return n / (e0.elapsed_time(e1) / 1e3) / 1e9


for chunk in (1 << 30, 16 << 20, 4 << 20):
    best = max(rate(chunk) for _ in range(5))
    print(f"H2D pinned, {n >> 20} MiB in copies of {chunk >> 20} MiB: {best:.2f} GB/s (best of 5)")
rates = sorted(rate(16 << 20) for _ in range(100))
median = rates[50]
slow = sum(r < 0.95 * median for r in rates)
print(f"H2D pinned, {n >> 20} MiB in copies of 16 MiB, 100 times: min {rates[0]:.2f}, median {median:.2f}, "
      f"max {rates[-1]:.2f} GB/s; {slow} below 95 % of the median")
