"""``python -m pyllama_headinfer plan``: choose the HeadInfer head fraction
from a VRAM budget, before loading anything.

    python -m pyllama_headinfer plan --model M.gguf --ctx 32768 [--vram 24GiB] [--ngl 99]
        [--type-k f16 --type-v f16] [--n-seq 1] [--kv-unified] [--no-swa-full] [--batch 512]
        [--margin 512MiB] [--bytes] [--layers] [--json]

Reads the GGUF metadata and tensor index only (no weights), prints one row per
g = 1 .. n_head_kv (device KV, host KV, the compute-buffer estimate, the
estimated device total) and marks the largest g that fits the budget. Exit
status 1 when nothing fits (the table is still printed; stderr says what
would fit), 2 for bad input. See docs/PLAN.md for the formulas.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from pyllama_headinfer.cli.options import ATTN_CHUNK_HELP, CTX_ZERO_HELP
from pyllama_headinfer.errors import EXIT_FAILURE, EXIT_OK
from pyllama_headinfer.params import KV_CACHE_TYPES, ContextParams, parse_size
from pyllama_headinfer.vram.model import read_model_info
from pyllama_headinfer.vram.plan import force_split_from_env, plan_kv
from pyllama_headinfer.vram.speed import load_calibration, rank_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", required=True, help="GGUF model file (only its metadata is read)")
    parser.add_argument("--ctx", "-c", type=int, required=True, help=f"context size in tokens ({CTX_ZERO_HELP})")
    parser.add_argument("--vram", "--vram-budget", dest="vram", default=None,
                        help="GPU memory budget, e.g. 24GiB, 80GB, 23000MiB (no budget: just the table)")
    parser.add_argument("--ngl", "--n-gpu-layers", dest="ngl", type=int, default=-1,
                        help="layers to offload (-1 = all, the default; llama.cpp counts the output layer as one)")
    parser.add_argument("--type-k", "--cache-type-k", dest="type_k", default="f16", choices=KV_CACHE_TYPES,
                        help="K cache type (default f16)")
    parser.add_argument("--type-v", "--cache-type-v", dest="type_v", default="f16", choices=KV_CACHE_TYPES,
                        help="V cache type (default f16)")
    parser.add_argument("--n-seq", dest="n_seq", type=int, default=1,
                        help="parallel sequences (n_seq_max; one KV stream each unless --kv-unified)")
    parser.add_argument("--kv-unified", action="store_true", help="one KV stream shared by all sequences")
    parser.add_argument("--swa-full", action=argparse.BooleanOptionalAction, default=True,
                        help="full-size SWA cache (llama_context_default_params: on; --no-swa-full: "
                             "window-sized, pad(n_swa + n_ubatch, 256) cells)")
    parser.add_argument("--batch", type=int, default=ContextParams.n_batch,
                        help=f"n_batch = n_ubatch, as generate sets them (default {ContextParams.n_batch})")
    parser.add_argument("--no-flash-attn", dest="flash_attn", action="store_false",
                        help="flash attention off (then no layer splits)")
    parser.add_argument("--headinfer-attn", dest="headinfer_attn", choices=("joined", "chunked"), default="joined",
                        help="plan one attention per layer (joined, the default: the device holds a split layer's "
                             "K/V whole, growing with the context) or attention in chunks (chunked: a fixed arena)")
    parser.add_argument("--headinfer-attn-chunk", dest="headinfer_attn_chunk", type=int, default=0,
                        help=ATTN_CHUNK_HELP)
    parser.add_argument("--force-split", action=argparse.BooleanOptionalAction, default=None,
                        help="plan as LLAMA_HEADINFER_FORCE_SPLIT=1 runs: layers in host memory split too "
                             "(default: from that variable)")
    parser.add_argument("--margin", default="0",
                        help="memory to keep free on the GPU besides llama.cpp's buffers, e.g. 512MiB for the "
                             "CUDA context (default 0)")
    parser.add_argument("--bytes", dest="exact", action="store_true", help="exact byte counts in the table")
    parser.add_argument("--layers", action="store_true", help="the per-layer head split of the choice")
    parser.add_argument("--json", action="store_true", help="the plan as JSON on stdout instead of the table")
    parser.add_argument("--rank", action=argparse.BooleanOptionalAction, default=None,
                        help="also rank KV type (f16, q8_0, q4_0) x fraction by predicted decode speed, with the "
                             "fastest and the fastest exact option (default: on with --vram)")
    parser.add_argument("--depth", type=int, default=None,
                        help="filled context the speed is predicted at (default: the whole context)")
    parser.add_argument("--speed-device", default=None,
                        help="use the speed constants `bench --calibrate` stored for this device "
                             "(default: the only stored ones, else the H200 defaults)")


def generate_command(args: argparse.Namespace) -> str:
    """The start of a ``generate`` command line for the plan's context: every option of the plan that generate has
    (its ranking appends the KV types and the fraction). Without them the printed command would run another context
    than the one planned: e.g. one attention per layer where the plan fits only in chunks."""
    parts = ["python -m pyllama_headinfer generate", f"--model {shlex.quote(str(args.model))}", f"--ctx {args.ctx}",
             f"--ngl {args.ngl}"]
    if args.batch != ContextParams.n_batch:  # generate's default
        parts.append(f"--batch {args.batch}")
    if not args.flash_attn:
        parts.append("--no-flash-attn")
    if args.headinfer_attn != "joined":
        parts.append(f"--headinfer-attn {args.headinfer_attn}")
    if args.headinfer_attn_chunk:
        parts.append(f"--headinfer-attn-chunk {args.headinfer_attn_chunk}")
    parts.append('--prompt "..."')
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    force = force_split_from_env() if args.force_split is None else args.force_split
    margin = parse_size(args.margin) if args.margin not in ("0", "", None) else 0
    params = ContextParams(n_ctx=args.ctx, n_batch=args.batch, n_ubatch=args.batch, n_seq_max=args.n_seq,
                           flash_attn=args.flash_attn, type_k=args.type_k, type_v=args.type_v,
                           kv_unified=args.kv_unified, swa_full=args.swa_full, headinfer_vram_budget=args.vram,
                           headinfer_attn=args.headinfer_attn, headinfer_attn_chunk=args.headinfer_attn_chunk)
    info = read_model_info(args.model)  # the GGUF is read once, for the plan and the ranking
    p = plan_kv(info, params, n_gpu_layers=args.ngl, force_split=force, margin=margin)
    nothing_fits = p.budget is not None and p.chosen is None
    ranking = None
    if args.rank or (args.rank is None and args.vram is not None):
        ranking = rank_options(info, params, depth=args.depth, constants=load_calibration(args.speed_device),
                               command_prefix=generate_command(args), n_gpu_layers=args.ngl, force_split=force,
                               margin=margin)
    if args.json:
        print(json.dumps({**p.to_dict(), **(ranking.to_dict() if ranking else {})}, indent=2))
    else:  # when nothing fits, the reason and what would fit go to stderr (once)
        print(p.format(exact=args.exact, per_layer=args.layers, summary=not nothing_fits))
        if ranking is not None:
            print()
            print(ranking.format())
    if nothing_fits:
        sys.stdout.flush()
        print(f"error: {p.error()}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK
