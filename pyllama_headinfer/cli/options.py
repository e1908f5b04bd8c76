"""Options that several commands share, defined once: how split layers attend and stream
(``--headinfer-attn``, ``--headinfer-attn-chunk``, ``--headinfer-stream``; ContextParams' fields
of the same names)."""

from __future__ import annotations

import argparse

from pyllama_headinfer.params import HEADINFER_ATTN_TYPES, HEADINFER_STREAM_TYPES


def add_headinfer_mode_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--headinfer-attn", choices=tuple(HEADINFER_ATTN_TYPES), default="joined",
                        help="HeadInfer: how a split layer's attention reads its two halves: joined (bit-identical "
                             "to frac 1.0; default), parts (no join, another float order on CUDA) or chunked "
                             "(every layer in chunks of KV cells merged exactly, the same at every fraction; "
                             "another float order than joined)")
    parser.add_argument("--headinfer-attn-chunk", type=int, default=0, metavar="CELLS",
                        help="HeadInfer: KV cells per chunk with --headinfer-attn chunked, a multiple of 256 "
                             "(default 0: llama.cpp's, 8192)")
    parser.add_argument("--headinfer-stream", choices=tuple(HEADINFER_STREAM_TYPES), default="gpu",
                        help="HeadInfer: copy the host heads one layer ahead on CUDA/HIP GPUs (gpu, default), when "
                             "their layer starts (off), or ahead on any async device (any: RPC, for tests)")
