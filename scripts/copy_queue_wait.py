#!/usr/bin/env python3
"""Does a small host-to-device copy wait behind large ones queued on another stream? (PyTorch, on the GPU machine)

The scheduler copies a graph's inputs (a few KiB: token positions, the attention mask, row indices) from pinned host
memory with a synchronous copy when the computation starts; with streaming, the next step's first split layers may
already be queued on the stream instance's copy engine. This times the small copy alone, then behind 1, 2 and 4
copies of 16 MiB (one layer's host K or V at 32K cells, f 0.75) queued on another stream just before it. A wait that
grows with the queue means the copies share one engine in order, and the host waits for what was queued first.

  python3 scripts/copy_queue_wait.py
"""
import statistics
import time

import torch

big = 16 << 20
small = 64 << 10
h_big = torch.empty(4 * big, dtype=torch.uint8).pin_memory()
d_big = torch.empty(4 * big, dtype=torch.uint8, device="cuda")
h_small = torch.empty(small, dtype=torch.uint8).pin_memory()
d_small = torch.empty(small, dtype=torch.uint8, device="cuda")
stream_big, stream_small = torch.cuda.Stream(), torch.cuda.Stream()

one_big = []
for rep in range(5):
    t0 = time.perf_counter()
    with torch.cuda.stream(stream_big):
        d_big[:big].copy_(h_big[:big], non_blocking=True)
    stream_big.synchronize()
    one_big.append(time.perf_counter() - t0)
print(f"one copy of 16 MiB alone: {1e3 * statistics.median(one_big):.3f} ms (median of 5)")

for n_queued in (0, 1, 2, 4):
    waits = []
    for rep in range(7):
        torch.cuda.synchronize()
        with torch.cuda.stream(stream_big):
            for i in range(n_queued):
                d_big[i * big:(i + 1) * big].copy_(h_big[i * big:(i + 1) * big], non_blocking=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream_small):
            d_small.copy_(h_small, non_blocking=True)
        stream_small.synchronize()
        waits.append(time.perf_counter() - t0)
    print(f"64 KiB copy, synchronous, behind {n_queued} queued copies of 16 MiB on another stream: "
          f"{1e3 * statistics.median(waits):.3f} ms (median of 7)")
torch.cuda.synchronize()
