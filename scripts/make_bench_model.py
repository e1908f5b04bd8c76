#!/usr/bin/env python3
"""Write a Llama-3-8B-shaped GGUF model for speed benchmarks (weights are zeros).

    python scripts/make_bench_model.py --out llama8b-shape-q4_k.gguf [--n-layer 32]
    python scripts/make_bench_model.py --out draft-1b.gguf --shape 1b   # a draft for speculative decoding

Shape of Llama-3-8B: 32 layers, n_embd 4096, 32 query / 8 KV heads of 128,
n_ff 14336, vocab 128256; matrices Q4_K, the output Q6_K (as in Q4_K_M),
norms F32: 4.6 GiB. KV cache: 128 KiB per token in f16.

``--shape 1b``: Llama-3.2-1B's shape (16 layers, n_embd 2048, 32 query / 8 KV
heads of 64, n_ff 8192), the same vocabulary as the 8B shape, so llama-server
accepts it as the 8B's draft model (``-md``): 0.7 GiB, KV 32 KiB per token.

The weights' values do not matter for speed, so they are written as zero
bytes (fast, deterministic, no NaN). The vocabulary is a placeholder SPM
vocab: the model is for llama-bench and timing, not for text.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # testing_models: the test-model writers

from testing_models import finish_gguf


def quantized_zeros(n_out: int, n_in: int, qtype) -> np.ndarray:
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return np.zeros((n_out, n_in // block * type_size), dtype=np.uint8)


def write_bench_model(path: Path, n_layer: int = 32, n_embd: int = 4096, n_head: int = 32, n_head_kv: int = 8,
                      head_dim: int = 128, n_ff: int = 14336, n_vocab: int = 128256,
                      label: str = "Llama-3-8B") -> Path:
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf import MODEL_TENSOR as T

    def name(kind, bid=None) -> str:
        base = gguf.TENSOR_NAMES[kind]
        return (base.format(bid=bid) if bid is not None else base) + ".weight"

    def mat(kind, n_out, n_in, bid=None, qtype=Q.Q4_K):
        w.add_tensor(name(kind, bid), quantized_zeros(n_out, n_in, qtype), raw_dtype=qtype)

    def norm(kind, bid=None):
        w.add_tensor(name(kind, bid), np.ones(n_embd, dtype=np.float32))

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"pyllama-headinfer bench model ({label} shape, zero weights)")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_context_length(131072)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"tok{i}" for i in range(n_vocab - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (n_vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    mat(T.TOKEN_EMBD, n_vocab, n_embd)
    norm(T.OUTPUT_NORM)
    mat(T.OUTPUT, n_vocab, n_embd, qtype=Q.Q6_K)
    for i in range(n_layer):
        norm(T.ATTN_NORM, i)
        mat(T.ATTN_Q, n_head * head_dim, n_embd, i)
        mat(T.ATTN_K, n_head_kv * head_dim, n_embd, i)
        mat(T.ATTN_V, n_head_kv * head_dim, n_embd, i)
        mat(T.ATTN_OUT, n_embd, n_head * head_dim, i)
        norm(T.FFN_NORM, i)
        mat(T.FFN_GATE, n_ff, n_embd, i)
        mat(T.FFN_UP, n_ff, n_embd, i)
        mat(T.FFN_DOWN, n_embd, n_ff, i, qtype=Q.Q6_K)
    return finish_gguf(w, tmp, path)


SHAPES = {  # write_bench_model's arguments
    "8b": dict(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=14336, label="Llama-3-8B"),
    "1b": dict(n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, head_dim=64, n_ff=8192, label="Llama-3.2-1B"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                    help="8b: Llama-3-8B (default); 1b: Llama-3.2-1B, a draft model with the same vocabulary")
    ap.add_argument("--n-layer", type=int, default=None, help="layers (default: the shape's)")
    args = ap.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    if args.n_layer is not None:
        shape["n_layer"] = args.n_layer
    path = write_bench_model(args.out, **shape)
    print(f"{path} ({path.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
