#!/usr/bin/env python3
"""How many scheduler splits the HeadInfer split adds to llama.cpp's graphs.

    python scripts/graph_splits.py --model M.gguf [--ngl 99] [--fracs 1,0.75,0.5,0.25] [--ctx 4096[,32768,...]] [--type f16]
                                   [--rpc N] [--streams N]

For each fraction a context is created and llama.cpp's own report of its
reserved graphs is read from the log ("graph (pp bs=512, tg bs=1): nodes = ...,
splits = PP / TG"): the number of pieces the backend scheduler cuts the prompt
and the decode graph into. Every split boundary between a GPU and the CPU
costs a synchronisation, so this is the figure to watch (GGML_SCHED_DEBUG=2
prints the splits themselves). Printed per fraction, with the extra decode
splits per split layer relative to frac 1.0, and the compute buffer of each
backend as llama.cpp reports it (it includes the scheduler's staging buffer
for streamed host inputs, patch 18), per context size. With --rpc N (a build
with -DGGML_RPC=ON) the layers go to N local RPC servers' devices: on a
machine without a GPU, with LLAMA_HEADINFER_FORCE_SPLIT=1, this shows how the
scheduler streams host memory to an offload device. With --streams N the context has N sequences with one
KV stream each (kv_unified = false, llama-server's slots with -np N).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pyllama_headinfer.runtime.log import capture_log, compute_buffers_mib
from pyllama_headinfer.llama import Context, Model, rpc_add_server

SPLITS_RE = re.compile(r"graph.*: nodes = (\d+)(?: / (\d+))?, splits = (\d+)(?: / (\d+))?")


# how the split layers are attended (--attn, --attn-chunk): ContextParams' names
HEADINFER = {"headinfer_attn": "joined"}


def graph_splits(model: Model, frac: float, n_ctx: int, kv_type: str, n_streams: int = 1,
                 n_ubatch: int = 512) -> tuple[int, int, int, int, dict[str, float]]:
    """(splits pp, splits tg, nodes tg, split layers, {backend: compute buffer MiB}) of the context's reserved graphs."""
    streams = {"n_seq_max": n_streams, "kv_unified": False} if n_streams > 1 else {}
    with capture_log() as log, Context(model, n_ctx=n_ctx, flash_attn=True, type_k=kv_type, type_v=kv_type,
                                       n_batch=max(512, n_ubatch), n_ubatch=n_ubatch,
                                       headinfer_gpu_heads_frac=frac, **streams, **HEADINFER) as ctx:
        report = ctx.kv_residency() or {"layers": []}
    n_split = sum(1 for x in report["layers"] if x["n_head_resident"] < x["n_head_kv"])
    compute = compute_buffers_mib(log)
    for level, text in log:
        m = SPLITS_RE.search(text)
        if m:
            nodes_pp, nodes_tg, splits_pp, splits_tg = m.groups()
            return int(splits_pp), int(splits_tg or splits_pp), int(nodes_tg or nodes_pp), n_split, compute
    raise RuntimeError("llama.cpp did not log its graph report (is its INFO log suppressed?)")


def main(argv: list[str] | None = None) -> int:
    from gpu_check import add_attn_arguments, headinfer_params, rpc_servers  # the exactness check's

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", required=True)
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--fracs", default="1,0.75,0.5,0.25")
    ap.add_argument("--ctx", default="4096", help="context sizes, comma-separated")
    ap.add_argument("--type", default="f16", help="KV type (K and V)")
    ap.add_argument("--ubatch", type=int, default=512, help="n_ubatch (the compute buffer grows with it)")
    ap.add_argument("--rpc", type=int, default=0, metavar="N", help="spread the layers over N local RPC servers' devices")
    add_attn_arguments(ap)
    ap.add_argument("--streams", type=int, default=1, metavar="N",
                    help="N sequences, one KV stream each (kv_unified = false, as llama-server's -np N)")
    args = ap.parse_args(argv)
    HEADINFER.update(headinfer_params(args))
    logging.getLogger("pyllama_headinfer.llama").setLevel(logging.INFO)

    with contextlib.ExitStack() as stack:
        endpoints = stack.enter_context(rpc_servers(args.rpc)) if args.rpc else []
        devices = [d for e in endpoints for d in rpc_add_server(e)] or None
        model = stack.enter_context(Model(args.model, n_gpu_layers=args.ngl, devices=devices))
        print(f"{'n_ctx':>7} {'frac':>5} {'split layers':>12} {'splits pp':>9} {'splits tg':>9} {'nodes tg':>8} "
              f"{'extra tg splits per split layer':>32}  compute buffers (MiB)")
        for n_ctx in (int(c) for c in args.ctx.split(",")):
            base_tg = None
            for frac in (float(f) for f in args.fracs.split(",")):
                pp, tg, nodes, n_split, compute = graph_splits(model, frac, n_ctx, args.type, args.streams, args.ubatch)
                base_tg = tg if base_tg is None else base_tg
                extra = f"{(tg - base_tg) / n_split:.2f}" if n_split else "-"
                buffers = ", ".join(f"{name} {mib:.1f}" for name, mib in compute.items())
                print(f"{n_ctx:>7} {frac:>5g} {n_split:>12} {pp:>9} {tg:>9} {nodes:>8} {extra:>32}  {buffers}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
