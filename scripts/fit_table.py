#!/usr/bin/env python3
"""llama.cpp's --fit with the split against --fit as it was, for cards of several sizes (docs/BENCHMARKS.md).

    python scripts/fit_table.py --bin build/cuda-new/bin --model b8.gguf --rows 32768:8,131072:12,131072:16

For each context and card size (GiB): llama-fit-params with ``--fit-target`` set so that fit may use the card's size
less llama.cpp's default 1 GiB margin of the GPU's free memory, which prints fit's choice and the answer it rejected.
Fit's layer fill is upstream's, unchanged, so its answer with layers in system memory is what --fit picked before the
split existed. Then each answer decodes 16 tokens at the full context, the answers of a row back to back, and the table
gives both: configuration, predicted and measured decode tok/s, and the wall time of the measurement.

Two ways to fill the context before the decode (``--fill``):

* ``bench`` (default): ``llama-bench -d CTX -n 16``, one run each: the fill computed by the answer itself. With layers
  on the CPU at 128K that fill is the CPU's attention over 128K cells in every such layer, far longer than a device
  call allows.
* ``state``: the context is filled once per context length with every layer and the whole KV cache on the GPU, its
  KV state saved (``llama_state_get_data``); each answer then loads that state into its own context and times 16
  decoded tokens after one untimed token, as llama-bench times its generation (each token decoded and synchronized).
  The decode reads the same number of cells either way; the values in them do not change its cost.

Both use one thread per physical core (llama-bench's default, passed to both explicitly with ``--threads``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
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
            config = {"ngl": 99, "frac": float(frac), "attn": attn}
            what = f"all layers on the GPU, {kv_dev} of {kv_all} MiB of KV there (-hgf {float(frac):g}, {attn})"
        else:
            config = {"ngl": int(ngl), "frac": 1.0, "attn": "joined"}
            what = f"{ngl} of {n_layer} layers on the GPU"
        out.append({"verdict": verdict, "config": config, "what": what, "predicted": float(tok_s)})
    return out


def physical_cores() -> int:
    """One thread per physical core, as llama-bench's default (common_cpu_get_num_math) counts them on Linux."""
    siblings = {Path(p).read_text().strip() for p in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/"
                                                                "thread_siblings_list")}
    return len(siblings) or os.cpu_count() or 1


def bench_args(config: dict) -> list[str]:
    """llama-bench's arguments for an answer's configuration."""
    args = ["-ngl", str(config["ngl"]), "-hgf", f"{config['frac']:g}"]
    return args + (["--headinfer-attn", "chunked"] if config["attn"] == "chunked" else [])


class BenchDecode:
    """``--fill bench``: llama-bench fills the context with the answer's own configuration, then decodes."""

    def __init__(self, bin_dir: Path, model: Path, type_kv: str, threads: int, n_gen: int):
        self.bin_dir, self.model, self.type_kv, self.threads, self.n_gen = bin_dir, model, type_kv, threads, n_gen

    def __call__(self, ctx: int, config: dict) -> tuple[float, float]:
        """(decode tok/s at depth ctx, wall seconds of the llama-bench call)."""
        argv = [str(self.bin_dir / "llama-bench"), "-m", str(self.model), "-fa", "1", "-ctk", self.type_kv,
                "-ctv", self.type_kv, "-p", "0", "-n", str(self.n_gen), "-d", str(ctx), "-r", "1", "-ub", "2048",
                "-t", str(self.threads), "-o", "json", *bench_args(config)]
        t0 = time.monotonic()
        run = subprocess.run(argv, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if run.returncode != 0:
            print(f"llama-bench failed: {' '.join(argv)}\n{run.stderr[-2000:]}", file=sys.stderr)
            return float("nan"), wall
        return float(json.loads(run.stdout)[0]["avg_ts"]), wall


class StateDecode:
    """``--fill state``: one fill per context length on the GPU, its KV state loaded by each answer (module doc).
    Needs the build's Python bindings (PYLLAMA_HEADINFER_BUILD_DIR)."""

    def __init__(self, model: Path, type_kv: str, threads: int, n_gen: int):
        self.model, self.type_kv, self.threads, self.n_gen = model, type_kv, threads, n_gen
        self.states: dict[int, bytes] = {}

    def context(self, model, ctx: int, config: dict):
        from pyllama_headinfer.llama import Context
        return Context(model, n_ctx=ctx + self.n_gen + 1, n_batch=2048, n_ubatch=2048, flash_attn=True,
                       type_k=self.type_kv, type_v=self.type_kv, n_threads=self.threads, n_threads_batch=self.threads,
                       headinfer_gpu_heads_frac=config["frac"], headinfer_attn=config["attn"])

    def state(self, ctx: int) -> bytes:
        if ctx not in self.states:
            from pyllama_headinfer.llama import Model
            self.states.clear()  # one context length's state at a time: 16 GiB at 128K with f16 KV
            with Model(self.model, n_gpu_layers=-1) as model, \
                    self.context(model, ctx, {"frac": 1.0, "attn": "joined"}) as c:
                c.decode([1 + i % (model.n_vocab - 1) for i in range(ctx)], logits="none")
                c.synchronize()
                self.states[ctx] = c.save_state(logits=False)
        return self.states[ctx]

    def __call__(self, ctx: int, config: dict) -> tuple[float, float]:
        """(decode tok/s after the filled state, wall seconds of the answer's load and decode; the fill not counted)."""
        from pyllama_headinfer.llama import Model
        state = self.state(ctx)
        t0 = time.monotonic()
        with Model(self.model, n_gpu_layers=config["ngl"]) as model, self.context(model, ctx, config) as c:
            c.load_state(state)
            token = [1]
            c.decode(token)  # untimed: the first decode after the load
            c.synchronize()
            t1 = time.monotonic()
            for _ in range(self.n_gen):
                c.decode(token)
                c.synchronize()
            tok_s = self.n_gen / (time.monotonic() - t1)
        return tok_s, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path, required=True, help="the build's bin directory (llama-fit-params, llama-bench)")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rows", default="32768:8,131072:12,131072:16", help="CTX:CARD_GIB,... (default: %(default)s)")
    ap.add_argument("--type", default="f16", help="KV cache type (default f16)")
    ap.add_argument("--log-dir", type=Path, default=None, help="keep llama-fit-params' logs here")
    ap.add_argument("--fill", choices=("bench", "state"), default="bench",
                    help="how the context is filled before the decode (module doc; default bench)")
    ap.add_argument("--threads", type=int, default=physical_cores(),
                    help="CPU threads for both fills (default: one per physical core, %(default)s here)")
    args = ap.parse_args(argv)
    n_gen = 16
    if args.fill == "bench":
        measure = BenchDecode(args.bin, args.model, args.type, args.threads, n_gen)
    else:
        measure = StateDecode(args.model, args.type, args.threads, n_gen)

    print(f"KV {args.type}; fit may use card - 1 GiB of the GPU memory free before each row; fill {args.fill}; "
          f"{args.threads} threads\n")
    print("| context | card | answer | configuration | predicted tok/s | decode tok/s | wall s |")
    print("|---|---|---|---|---|---|---|")
    for row in args.rows.split(","):
        ctx, card = (int(x) for x in row.split(":"))
        # free memory now, not at the start: a state fill leaves this process holding device memory (the CUDA
        # context, ggml's pool) that fit would otherwise count against the card
        free = gpu_free_mib()
        margin = free - (card - 1) * 1024
        fit = subprocess.run([str(args.bin / "llama-fit-params"), "-m", str(args.model), "-c", str(ctx), "-fa", "on",
                              "-ctk", args.type, "-ctv", args.type, "-fitt", str(margin)],
                             capture_output=True, text=True)
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            (args.log_dir / f"fit-{ctx}-{card}-{args.type}.log").write_text(
                f"GPU free memory before fit: {free} MiB, --fit-target {margin}\n" + fit.stderr + fit.stdout)
        found = answers(fit.stderr)
        if not found:
            line = fit.stdout.strip().splitlines()[-1] if fit.stdout.strip() else f"exit {fit.returncode}"
            print(f"| {ctx} | {card} GiB | fit | `{line}` (no split considered) | | | |")
            continue
        for a in found:
            tok_s, wall = measure(ctx, a["config"])
            print(f"| {ctx} | {card} GiB | {a['verdict']} | {a['what']} | {a['predicted']:.1f} | {tok_s:.2f} | "
                  f"{wall:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
