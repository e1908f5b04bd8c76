#!/usr/bin/env python3
"""How many scheduler splits the HeadInfer split adds to llama.cpp's graphs.

    python scripts/graph_splits.py --model M.gguf [--ngl 99] [--fracs 1,0.75,0.5,0.25] [--ctx 4096] [--type f16]

For each fraction a context is created and llama.cpp's own report of its
reserved graphs is read from the log ("graph (pp bs=512, tg bs=1): nodes = ...,
splits = PP / TG"): the number of pieces the backend scheduler cuts the prompt
and the decode graph into. Every split boundary between a GPU and the CPU
costs a synchronisation, so this is the figure to watch (GGML_SCHED_DEBUG=2
prints the splits themselves). Printed per fraction, with the extra decode
splits per split layer relative to frac 1.0.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyllama_headinfer.runtime.log import capture_log
from pyllama_headinfer.llama import Context, Model

SPLITS_RE = re.compile(r"graph.*: nodes = (\d+)(?: / (\d+))?, splits = (\d+)(?: / (\d+))?")


def graph_splits(model: Model, frac: float, n_ctx: int, kv_type: str) -> tuple[int, int, int, int]:
    """(nodes pp, nodes tg, splits pp, splits tg) of the context's reserved graphs; and the split layers."""
    with capture_log() as log, Context(model, n_ctx=n_ctx, flash_attn=True, type_k=kv_type, type_v=kv_type,
                                                headinfer_gpu_heads_frac=frac) as ctx:
        report = ctx.kv_residency() or {"layers": []}
    n_split = sum(1 for x in report["layers"] if x["n_head_resident"] < x["n_head_kv"])
    for level, text in log:
        m = SPLITS_RE.search(text)
        if m:
            nodes_pp, nodes_tg, splits_pp, splits_tg = m.groups()
            return int(splits_pp), int(splits_tg or splits_pp), int(nodes_tg or nodes_pp), n_split
    raise RuntimeError("llama.cpp did not log its graph report (is its INFO log suppressed?)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", required=True)
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--fracs", default="1,0.75,0.5,0.25")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--type", default="f16", help="KV type (K and V)")
    args = ap.parse_args(argv)
    logging.getLogger("pyllama_headinfer.llama").setLevel(logging.INFO)

    with Model(args.model, n_gpu_layers=args.ngl) as model:
        base_tg = None
        print(f"{'frac':>5} {'split layers':>12} {'splits pp':>9} {'splits tg':>9} {'nodes tg':>8} {'extra tg splits per split layer':>32}")
        for frac in (float(f) for f in args.fracs.split(",")):
            pp, tg, nodes, n_split = graph_splits(model, frac, args.ctx, args.type)
            base_tg = tg if base_tg is None else base_tg
            extra = f"{(tg - base_tg) / n_split:.2f}" if n_split else "-"
            print(f"{frac:>5g} {n_split:>12} {pp:>9} {tg:>9} {nodes:>8} {extra:>32}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
