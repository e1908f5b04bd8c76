#!/usr/bin/env python3
"""The plan's prediction against what llama.cpp really allocates on the GPU.

    python -m pyllama_headinfer build                      # CUDA build
    python scripts/plan_check.py --model b8.gguf --ctx 8192,32768,131072 --fracs 1,0.75,0.5,0.25 \\
        [--types f16,q8_0] [--ngl 99] [--device CUDA0] [--ubatch 512] [--attn joined|chunked]
        [--json out.json]

    # without a GPU: a local RPC server's device (a build with -DGGML_RPC=ON), which allocates as CUDA does
    LLAMA_HEADINFER_FORCE_SPLIT=1 PYLLAMA_HEADINFER_BUILD_DIR=<rpc build> python scripts/plan_check.py --rpc \\
        --model b8.gguf --ctx 8192,32768 --ubatch 2048 --attn chunked

For each model, context size, KV type and fraction: ``plan_kv`` predicts the
device's KV bytes (as CUDA allocates them), its compute buffer and the total
with the weights; then a real context is created and compared with

- the ``<device> model/KV/compute buffer size`` lines llama.cpp logs (MiB, 2 decimals),
- the residency report (exact KV bytes in the device buffers),
- the GPU's used memory before and after creating the context (nvidia-smi;
  this also counts what no log line shows: the CUDA context, cuBLAS workspaces).

Prints one row per run and the worst total difference (the acceptance is KV
exact, total within 5 %). The model is loaded once per file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pyllama_headinfer.params import ContextParams
from pyllama_headinfer.runtime.log import capture_log
from pyllama_headinfer.llama import Context, Model, rpc_add_server
from pyllama_headinfer.vram.plan import force_split_from_env, plan_kv

MIB = 1 << 20


def gpu_used_mib() -> float | None:
    """Used memory of GPU 0 in MiB (nvidia-smi), None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, check=True).stdout
        return float(out.strip().splitlines()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def logged_mib(log, device: str, what: str) -> float:
    # an RPC device is named with its server's endpoint: RPC0[127.0.0.1:PORT]
    name = re.escape(device) + (r"\[[^\]]*\]" if device.startswith("RPC") else "")
    pattern = re.compile(rf"{name} {what} buffer size = +([\d.]+) MiB")
    return sum(float(m.group(1)) for _, text in log for m in [pattern.search(text)] if m)


def check_one(model: Model, model_log, device: str, n_ctx: int, frac: float, kv: str, ngl: int, n_ubatch: int = 512,
              headinfer: dict | None = None) -> dict:
    params = ContextParams(n_ctx=n_ctx, type_k=kv, type_v=kv, kv_unified=False, swa_full=True,
                           headinfer_gpu_heads_frac=frac, n_batch=max(512, n_ubatch), n_ubatch=n_ubatch,
                           **(headinfer or {}))
    # the one planned and the one created: the same params
    plan = plan_kv(model.gguf, params, n_gpu_layers=ngl, force_split=force_split_from_env())
    row = plan.row_for_frac(frac)
    before = gpu_used_mib()
    with capture_log() as log, Context(model, params) as ctx:
        after = gpu_used_mib()
        report = ctx.kv_residency()
    device_kv_exact = sum(b["k"] + b["v"] for name, b in report["buffers"].items()
                          if (name == device or name.startswith(device + "[")) and not b["headinfer_host"])
    got = {"weights": logged_mib(model_log, device, "model"), "KV": logged_mib(log, device, "KV"),
           "compute": logged_mib(log, device, "compute")}
    want = {"weights": plan.weights.device_alloc / MIB, "KV": row.device_kv_alloc / MIB, "compute": row.compute / MIB}
    got["total"], want["total"] = sum(got.values()), sum(want.values())
    return {"model": model.path.name, "n_ctx": n_ctx, "kv": kv, "frac": frac, "got": got, "plan": want,
            "device_kv_exact": device_kv_exact, "plan_device_kv": row.device_kv,
            "smi_context_mib": None if before is None or after is None else after - before}


def main(argv: list[str] | None = None) -> int:
    from gpu_check import add_attn_arguments, headinfer_params, rpc_servers  # the exactness check's

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", action="append", required=True, help="GGUF model (repeatable)")
    ap.add_argument("--ctx", default="8192,32768")
    ap.add_argument("--fracs", default="1,0.5,0.25")
    ap.add_argument("--types", default="f16")
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--device", default="CUDA0", help="buffer name of the GPU in llama.cpp's log (default CUDA0)")
    ap.add_argument("--ubatch", type=int, default=512, help="n_ubatch (the compute buffer grows with it)")
    add_attn_arguments(ap)  # --attn, --attn-chunk
    ap.add_argument("--rpc", action="store_true",
                    help="a local RPC server's device instead of a GPU (--device RPC0; a build with -DGGML_RPC=ON)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.rpc and args.device == "CUDA0":
        args.device = "RPC0"
    logging.getLogger("pyllama_headinfer.llama").setLevel(logging.INFO)

    results = []
    print(f"{'model':18} {'n_ctx':>7} {'kv':5} {'frac':>5} | {'KV MiB plan/got':>21} | {'compute plan/got':>19} | "
          f"{'total plan/got':>21} {'diff':>6} | {'KV bytes exact':>14} | {'smi Δ MiB':>9}")
    with contextlib.ExitStack() as stack:
        devices = None
        if args.rpc:
            devices = rpc_add_server(stack.enter_context(rpc_servers(1))[0])
        worst, kv_exact = check_models(args, devices, results, headinfer_params(args))
    print(f"worst total difference {worst:.1f}% ({'within' if worst <= 5 else 'OUTSIDE'} 5%); "
          f"device KV bytes {'exact in every run' if kv_exact else 'NOT exact'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if worst <= 5 and kv_exact else 1


def check_models(args, devices, results: list, headinfer: dict) -> tuple[float, bool]:
    """Every model x KV type x context x fraction of ``args``: rows printed, results appended; (worst total
    difference in %, device KV bytes exact in every run)."""
    worst, kv_exact = 0.0, True
    for path in args.model:
        with capture_log() as model_log, Model(path, n_gpu_layers=args.ngl, devices=devices) as model:
            model_log = list(model_log)
            for kv in args.types.split(","):
                for n_ctx in (int(c) for c in args.ctx.split(",")):
                    for frac in (float(f) for f in args.fracs.split(",")):
                        r = check_one(model, model_log, args.device, n_ctx, frac, kv, args.ngl, args.ubatch, headinfer)
                        results.append(r)
                        g, w = r["got"], r["plan"]
                        diff = (w["total"] - g["total"]) / g["total"] * 100 if g["total"] else float("nan")
                        # no matching log line (a wrong --device) is a failure, not a perfect match
                        worst = float("inf") if math.isnan(diff) else max(worst, abs(diff))
                        exact = r["device_kv_exact"] == r["plan_device_kv"]
                        kv_exact &= exact
                        smi = "-" if r["smi_context_mib"] is None else f"{r['smi_context_mib']:.0f}"
                        print(f"{r['model'][:18]:18} {n_ctx:>7} {kv:5} {frac:>5g} | {w['KV']:>10.2f}/{g['KV']:<10.2f} | "
                              f"{w['compute']:>9.2f}/{g['compute']:<9.2f} | {w['total']:>10.2f}/{g['total']:<10.2f} "
                              f"{diff:>+5.1f}% | {('yes' if exact else 'NO'):>14} | {smi:>9}", flush=True)
    return worst, kv_exact


if __name__ == "__main__":
    sys.exit(main())
