#!/usr/bin/env python3
"""llama.cpp's --fit with the split against --fit as it was, for cards of several sizes (docs/BENCHMARKS.md).

    python scripts/fit_table.py --bin build/cuda-new/bin --model b8.gguf --rows 32768:8,131072:12,131072:16

For each context and card size (GiB): llama-fit-params with ``--fit-target`` set so that fit may use the card's size
less llama.cpp's default 1 GiB margin of the GPU's free memory, which prints fit's choice and the answer it rejected.
Fit's layer fill is upstream's, unchanged, so its answer with layers in system memory is what --fit picked before the
split existed. Then llama-bench decodes each answer at the full context (``-d CTX -n 16``, one run each, the answers of
a row back to back), and the table gives both: configuration, predicted and measured decode tok/s, and the wall time
of the llama-bench call (the fill of the context and the decode).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

CHOICE_RE = re.compile(r"(chose|rejected) (?:every layer on the device, (\d+) of (\d+) MiB of KV in device memory "
                       r"\(headinfer_gpu_heads_frac = ([0-9.e-]+), (joined|chunked) attention\)|(-?\d+) of (\d+) layers "
                       r"on the device): ([0-9.]+) tokens/s predicted")


def gpu_free_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def answers(log: str) -> list[dict]:
    """fit's two logged answers: {"verdict", "args" (llama-bench's), "what", "predicted"}."""
    out = []
    for m in CHOICE_RE.finditer(log):
        verdict, kv_dev, kv_all, frac, attn, ngl, n_layer, tok_s = m.groups()
        if frac is not None:
            args = ["-ngl", "99", "-hgf", frac] + (["--headinfer-attn", "chunked"] if attn == "chunked" else [])
            what = f"all layers on the GPU, {kv_dev} of {kv_all} MiB of KV there (-hgf {float(frac):g}, {attn})"
        else:
            args = ["-ngl", ngl, "-hgf", "1"]
            what = f"{ngl} of {n_layer} layers on the GPU"
        out.append({"verdict": verdict, "args": args, "what": what, "predicted": float(tok_s)})
    return out


def decode(bin_dir: Path, model: Path, ctx: int, type_kv: str, args: list[str]) -> tuple[float, float]:
    """(decode tok/s at depth ctx, wall seconds of the llama-bench call)."""
    argv = [str(bin_dir / "llama-bench"), "-m", str(model), "-fa", "1", "-ctk", type_kv, "-ctv", type_kv, "-p", "0",
            "-n", "16", "-d", str(ctx), "-r", "1", "-ub", "2048", "-o", "json", *args]
    t0 = time.monotonic()
    run = subprocess.run(argv, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if run.returncode != 0:
        print(f"llama-bench failed: {' '.join(argv)}\n{run.stderr[-2000:]}", file=sys.stderr)
        return float("nan"), wall
    return float(json.loads(run.stdout)[0]["avg_ts"]), wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path, required=True, help="the build's bin directory (llama-fit-params, llama-bench)")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rows", default="32768:8,131072:12,131072:16", help="CTX:CARD_GIB,... (default: %(default)s)")
    ap.add_argument("--type", default="f16", help="KV cache type (default f16)")
    ap.add_argument("--log-dir", type=Path, default=None, help="keep llama-fit-params' logs here")
    args = ap.parse_args(argv)

    free = gpu_free_mib()
    print(f"GPU free memory at the start: {free} MiB; KV {args.type}; fit may use card - 1 GiB\n")
    print("| context | card | answer | configuration | predicted tok/s | decode tok/s | llama-bench wall s |")
    print("|---|---|---|---|---|---|---|")
    for row in args.rows.split(","):
        ctx, card = (int(x) for x in row.split(":"))
        margin = free - (card - 1) * 1024
        fit = subprocess.run([str(args.bin / "llama-fit-params"), "-m", str(args.model), "-c", str(ctx), "-fa", "on",
                              "-ctk", args.type, "-ctv", args.type, "-fitt", str(margin)],
                             capture_output=True, text=True)
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            (args.log_dir / f"fit-{ctx}-{card}-{args.type}.log").write_text(fit.stderr + fit.stdout)
        found = answers(fit.stderr)
        if not found:
            line = fit.stdout.strip().splitlines()[-1] if fit.stdout.strip() else f"exit {fit.returncode}"
            print(f"| {ctx} | {card} GiB | fit | `{line}` (no split considered) | | | |")
            continue
        for a in found:
            tok_s, wall = decode(args.bin, args.model, ctx, args.type, a["args"])
            print(f"| {ctx} | {card} GiB | {a['verdict']} | {a['what']} | {a['predicted']:.1f} | {tok_s:.2f} | "
                  f"{wall:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
