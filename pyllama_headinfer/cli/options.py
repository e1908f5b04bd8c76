"""Options that several commands share, defined once: how split layers attend (``--headinfer-attn``,
``--headinfer-attn-chunk``; ContextParams' fields of the same names), the CPU threads (``--threads``)
and what ``--ctx 0`` means."""

from __future__ import annotations

import argparse

from pyllama_headinfer.params import HEADINFER_ATTN_TYPES, default_n_threads


# --headinfer-attn-chunk, here and in plan
ATTN_CHUNK_HELP = ("KV cells per chunk with --headinfer-attn chunked, a multiple of 256 (default 0: the model's, "
                   "32 MiB of its largest layer's K and V in F16, e.g. 8192 cells for 8 KV heads of 128)")

# --ctx 0 (llama_context_params.n_ctx 0): llama.cpp takes the model's training context, here and in plan
CTX_ZERO_HELP = "0 = the model's training context"

# the threads' default, said where llama.cpp's (4, or llama-server's physical cores) would be assumed
THREADS_DEFAULT_HELP = "the CPUs this process may run on, {n} here"


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads``/``-t``: ContextParams.n_threads (and n_threads_batch); None = :func:`default_n_threads`."""
    parser.add_argument("--threads", "-t", type=int, default=None,
                        help=f"CPU threads, for the prompt too (default: "
                             f"{THREADS_DEFAULT_HELP.format(n=default_n_threads())})")


def add_headinfer_mode_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--headinfer-attn", choices=tuple(HEADINFER_ATTN_TYPES), default="joined",
                        help="HeadInfer: how a split layer's attention reads its two halves: joined (bit-identical "
                             "to frac 1.0; default) or chunked (every layer in chunks of KV cells merged exactly, the "
                             "same at every fraction, one chunk of a layer's host heads on the device at a time; "
                             "another float order than joined)")
    parser.add_argument("--headinfer-attn-chunk", type=int, default=0, metavar="CELLS",
                        help="HeadInfer: " + ATTN_CHUNK_HELP)
