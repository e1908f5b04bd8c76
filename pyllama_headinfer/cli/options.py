"""Options that several commands share, defined once: how split layers attend
(``--headinfer-attn``, ``--headinfer-attn-chunk``; ContextParams' fields of the same names)."""

from __future__ import annotations

import argparse

from pyllama_headinfer.params import HEADINFER_ATTN_TYPES


# --headinfer-attn-chunk, here and in plan
ATTN_CHUNK_HELP = ("KV cells per chunk with --headinfer-attn chunked, a multiple of 256 (default 0: the model's, "
                   "32 MiB of its largest layer's K and V in F16, e.g. 8192 cells for 8 KV heads of 128)")


def add_headinfer_mode_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--headinfer-attn", choices=tuple(HEADINFER_ATTN_TYPES), default="joined",
                        help="HeadInfer: how a split layer's attention reads its two halves: joined (bit-identical "
                             "to frac 1.0; default) or chunked (every layer in chunks of KV cells merged exactly, the "
                             "same at every fraction, one chunk of a layer's host heads on the device at a time; "
                             "another float order than joined)")
    parser.add_argument("--headinfer-attn-chunk", type=int, default=0, metavar="CELLS",
                        help="HeadInfer: " + ATTN_CHUNK_HELP)
