"""``python -m pyllama_headinfer generate``: generate text with HeadInfer.

    python -m pyllama_headinfer generate --model M.gguf --prompt "Once upon a time" -n 64 \\
        [--frac 0.5 | --vram-budget 24GiB] [--ngl -1] [--ctx 4096] [--seed 42] [--temp 0.8]

``--ctx 0`` takes the model's training context (llama.cpp's rule for n_ctx 0).

The generated text goes to stdout (streamed); the speed (prompt and
generation tokens/s) and the KV residency report -- where llama.cpp allocated
the KV cache, per buffer type, and how each layer's heads are split -- go to
stderr, so the text can be piped.
"""

from __future__ import annotations

import argparse
import codecs
import logging
import sys
import time

from pyllama_headinfer.api.context import Context, resolve_vram_budget
from pyllama_headinfer.api.model import Model
from pyllama_headinfer.api.residency import format_kv_residency, split_summary
from pyllama_headinfer.api.sampler import Sampler
from pyllama_headinfer.errors import EXIT_OK, UsageError
from pyllama_headinfer.cli.options import CTX_ZERO_HELP, add_headinfer_mode_arguments, add_threads_argument
from pyllama_headinfer.params import ContextParams
from pyllama_headinfer.runtime import bindings
from pyllama_headinfer.vram.speed import rank_options

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", required=True, help="GGUF model file")
    parser.add_argument("--prompt", "-p", required=True, help="prompt text")
    parser.add_argument("-n", "--n-predict", dest="n", type=int, default=64, help="tokens to generate (default 64)")
    headinfer = parser.add_mutually_exclusive_group()
    headinfer.add_argument("--frac", type=float, default=None,
                           help="HeadInfer: fraction of each layer's KV heads kept on the device, in [0, 1] "
                                "(default 1.0 = off)")
    headinfer.add_argument("--vram-budget", default=None,
                           help="HeadInfer: derive the fraction from a GPU memory budget, e.g. 24GiB, or 'auto' "
                                "(the GPU's free memory less llama.cpp's 1 GiB --fit margin; instead of --frac; "
                                "see the plan command)")
    add_headinfer_mode_arguments(parser)
    parser.add_argument("--ngl", "--n-gpu-layers", dest="ngl", type=int, default=-1,
                        help="layers to offload to the GPU (-1 = all, llama.cpp's default: every layer on "
                             "the GPU when there is one; 0 = CPU only)")
    parser.add_argument("--ctx", "-c", type=int, default=4096,
                        help=f"context size in tokens (default 4096; {CTX_ZERO_HELP})")
    parser.add_argument("--batch", type=int, default=ContextParams.n_batch,
                        help=f"logical batch size (default {ContextParams.n_batch})")
    add_threads_argument(parser)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    parser.add_argument("--temp", type=float, default=0.8, help="temperature; <= 0 means greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=40, help="top-k (default 40, 0 = off)")
    parser.add_argument("--top-p", type=float, default=0.95, help="top-p (default 0.95, 1 = off)")
    parser.add_argument("--min-p", type=float, default=0.05, help="min-p (default 0.05, 0 = off)")
    parser.add_argument("--no-flash-attn", dest="flash_attn", action="store_false",
                        help="disable flash attention (HeadInfer needs it to split a layer)")
    parser.add_argument("--cache-type-k", default=None,
                        help="K cache type (default f16; with --vram-budget: the fastest option that fits)")
    parser.add_argument("--cache-type-v", default=None,
                        help="V cache type (default f16; with --vram-budget: the fastest option that fits)")
    parser.add_argument("--allow-quantized-kv", action="store_true",
                        help="with --vram-budget: also consider q8_0/q4_0 caches (faster, but not exact); "
                             "default: the fastest exact option")
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="print the text once at the end instead of token by token")


def context_params(args: argparse.Namespace) -> ContextParams:
    """The context the arguments ask for (checked: a bad value is a ValueError naming it)."""
    return ContextParams(n_ctx=args.ctx, n_batch=args.batch, n_ubatch=args.batch, n_threads=args.threads,
                         flash_attn=args.flash_attn, type_k=args.cache_type_k or "f16",
                         type_v=args.cache_type_v or "f16", headinfer_gpu_heads_frac=args.frac,
                         headinfer_vram_budget=args.vram_budget, headinfer_attn=args.headinfer_attn,
                         headinfer_attn_chunk=args.headinfer_attn_chunk)


def kv_type_for_budget(model: Model, params: ContextParams, args: argparse.Namespace) -> str:
    """The KV type of the fastest option that fits --vram-budget: exact (f16) unless
    --allow-quantized-kv; says what it picked and what the fastest overall would be.
    Planned from the GGUF the model read (not read again)."""
    ranking = rank_options(model.gguf, params, n_gpu_layers=args.ngl)
    pick = ranking.choose(args.allow_quantized_kv)
    if pick is None:
        return params.type_k  # nothing fits: the context's own plan says so, with what would fit
    other = ranking.faster_alternative(pick)
    log.info("--vram-budget: %s cache, frac %.6g (%.1f tok/s predicted at a full context)%s", pick.type_k,
             pick.frac, pick.predicted_decode_tok_s, f"; {other}" if other else "")
    return pick.type_k


def run(args: argparse.Namespace) -> int:
    params = context_params(args)  # checked before the (slow) model load
    if args.n < 0:
        raise UsageError("-n must be >= 0")
    err = sys.stderr
    choose_kv_type = args.vram_budget is not None and args.cache_type_k is None and args.cache_type_v is None
    t0 = time.perf_counter()
    with Sampler.from_params(args.temp, args.top_k, args.top_p, args.min_p, args.seed) as sampler, \
            Model(args.model, n_gpu_layers=args.ngl) as model:
        params = resolve_vram_budget(model, params)  # --vram-budget auto: the free device memory, now known
        if choose_kv_type:
            kv = kv_type_for_budget(model, params, args)
            params = params.replace(type_k=kv, type_v=kv)
        ctx = Context(model, params)
        t_load = time.perf_counter() - t0
        with ctx:
            return _generate(args, model, ctx, sampler, t_load, err)


def _generate(args: argparse.Namespace, model: Model, ctx: Context, sampler: Sampler, t_load: float, err) -> int:
    """Stream the text to stdout, then the speed and the residency report to stderr."""
    prompt = model.tokenize(args.prompt, add_special=True)
    if not prompt:
        raise UsageError("the prompt tokenizes to nothing")

    out = sys.stdout
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    generated: list[int] = []
    t_prompt = None
    t1 = time.perf_counter()
    gen = ctx.generate(prompt, args.n, sampler)
    for tok in gen:
        if t_prompt is None:
            t_prompt = time.perf_counter() - t1  # prompt eval + first sample
            t2 = time.perf_counter()
        generated.append(tok)
        if model.is_eog(tok):
            continue
        if args.stream:
            out.write(decoder.decode(model.token_to_piece(tok)))
            out.flush()
    t_gen = time.perf_counter() - t2 if t_prompt is not None else 0.0
    if args.stream:
        out.write(decoder.decode(b"", final=True) + "\n")
    else:
        out.write(model.detokenize([t for t in generated if not model.is_eog(t)]) + "\n")
    out.flush()

    n_gen = len(generated)
    print(f"model: {model.path.name} ({model.description}), load {t_load:.2f} s", file=err)
    if t_prompt is not None:
        print(f"prompt: {len(prompt)} tokens, {len(prompt) / max(t_prompt, 1e-9):.1f} tokens/s", file=err)
    # the first token comes with the prompt; the other n_gen - 1 each cost one decode
    if n_gen > 1:
        print(f"generation: {n_gen} tokens, {(n_gen - 1) / max(t_gen, 1e-9):.1f} tokens/s", file=err)
    else:
        print(f"generation: {n_gen} tokens", file=err)
    print(f"headinfer_gpu_heads_frac: {ctx.headinfer_gpu_heads_frac}", file=err)
    if ctx.headinfer_plan is not None:
        print(f"  {ctx.headinfer_plan.summary()}", file=err)
    elif args.vram_budget is not None:
        print("  --vram-budget ignored: this build has no GPU offload", file=err)
    if bindings.has_kv_residency():
        report = ctx.kv_residency()
        if ctx.headinfer_gpu_heads_frac < 1.0:  # what llama.cpp made of the fraction
            print(f"  {split_summary(report)}", file=err)
        print(format_kv_residency(report), file=err)
    else:
        print("KV residency: not available (this libllama has no llama_memory_get_kv_buffers)", file=err)
    return EXIT_OK
