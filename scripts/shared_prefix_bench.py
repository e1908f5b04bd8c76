#!/usr/bin/env python3
"""n continuations of one long prompt, decoded together: aggregate tok/s.

    python scripts/shared_prefix_bench.py --model b8.gguf --depth 32768 --n 1,2,4,8 --fracs 1,0.5 --ngl 99

The prompt (``--depth`` filler tokens) is decoded once per fraction, in
sequence 0 of a unified KV cache. For each n, sequences 1..n-1 get the
prefix by ``seq_cp`` (shared cells, no copy), then ``--tokens`` steps decode
one token of every sequence in one batch (what ``Context.generate_shared``
does); the generated cells are removed again before the next n. Aggregate
tok/s = n x steps / time. With HeadInfer the host heads of the prefix cross
the link once per step whatever n is, so the aggregate should grow with n
much more than at frac 1.0 (docs/SERVING.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--depth", type=int, default=32768)
    ap.add_argument("--n", default="1,2,4,8", help="numbers of continuations")
    ap.add_argument("--fracs", default="1,0.5")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--batch", type=int, default=2048)
    args = ap.parse_args(argv)

    from pyllama_headinfer.llama import Context, Model

    ns = [int(x) for x in args.n.split(",")]
    n_max = max(ns)
    print("| frac | n | steps | s | aggregate tok/s | per sequence tok/s |")
    print("|---|---|---|---|---|---|")
    with Model(args.model, n_gpu_layers=args.ngl) as model:
        filler = model.tokenize(" the quick brown fox jumps over the lazy dog", add_special=False)
        filler = filler * (args.depth // len(filler) + 1)
        prompt = (model.tokenize("", add_special=True) + filler)[: args.depth]  # BOS (if any) + filler
        token = filler[0]
        for frac in (float(f) for f in args.fracs.split(",")):
            n_ctx = args.depth + n_max * (args.tokens + 2) + 256
            with Context(model, n_ctx=n_ctx, n_batch=args.batch, n_ubatch=min(args.batch, 2048), n_seq_max=n_max,
                         kv_unified=True, headinfer_gpu_heads_frac=frac) as ctx:
                ctx.decode(prompt, logits="none")
                ctx.synchronize()
                for n in ns:
                    for s in range(1, n):
                        ctx.seq_cp(0, s)
                    ctx.decode_batch({s: [token] for s in range(n)})  # warm-up step, untimed
                    ctx.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.tokens):
                        ctx.decode_batch({s: [token] for s in range(n)})
                    ctx.synchronize()
                    dt = time.perf_counter() - t0
                    print(f"| {frac:g} | {n} | {args.tokens} | {dt:.3f} | {n * args.tokens / dt:.2f} | "
                          f"{args.tokens / dt:.2f} |", flush=True)
                    for s in range(n):  # back to the bare prefix
                        ctx.seq_rm(s, len(prompt), -1)
                    for s in range(1, n):
                        ctx.seq_rm(s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
