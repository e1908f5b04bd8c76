""":func:`quantize_model`: llama.cpp's own quantizer (``llama_model_quantize``), for
making quantized GGUF files from F16/F32 ones -- e.g. small test models whose
weights reach the CPU's quantized kernels (AMX, AVX-512, repacked Q4_0/Q8_0)."""

from __future__ import annotations

import errno
import numbers
import os
from pathlib import Path

from pyllama_headinfer.errors import ModelError
from pyllama_headinfer.runtime import bindings
from pyllama_headinfer.runtime.log import checked_call
from pyllama_headinfer.vram.gguf import read_gguf

# the file types offered: name -> llama_ftype (llama-quantize's names, lower case)
QUANT_FTYPES = {
    "f32": "LLAMA_FTYPE_ALL_F32",
    "f16": "LLAMA_FTYPE_MOSTLY_F16",
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
}


def quantize_model(src: str | os.PathLike, dst: str | os.PathLike, ftype: str = "q8_0", *,
                   n_threads: int = 0) -> Path:
    """Write ``src`` quantized to ``ftype`` (one of :data:`QUANT_FTYPES`) as ``dst``.

    The file is written under a temporary name next to ``dst`` and renamed when
    llama.cpp succeeded, so a failure never leaves a partial ``dst`` (nor
    touches an existing one). Tensors whose rows do not fit the type's blocks
    fall back to another type, as in llama-quantize. ``n_threads`` 0 = all cores."""
    src, dst = Path(os.fspath(src)), Path(os.fspath(dst))
    if ftype not in QUANT_FTYPES:
        raise ValueError(f"ftype must be one of {sorted(QUANT_FTYPES)}, got {ftype!r}")
    if not isinstance(n_threads, numbers.Integral) or n_threads < 0:
        raise ValueError(f"n_threads must be an int >= 0, got {n_threads!r}")
    if not src.is_file():
        raise FileNotFoundError(errno.ENOENT, "model file not found", str(src))
    if not dst.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "output directory not found", str(dst.parent))
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"the output would overwrite the input: {dst}")
    read_gguf(src)  # the pre-flight check: a corrupt file is a ModelError, not a crash in the quantizer
    ffi, lib = bindings.load()
    params = ffi.new("llama_model_quantize_params *", lib.llama_model_quantize_default_params())
    params.nthread = int(n_threads)
    params.ftype = getattr(lib, QUANT_FTYPES[ftype])
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    try:
        checked_call(lib.llama_model_quantize, os.fsencode(src), os.fsencode(tmp), params, ok=lambda rc: rc == 0,
                     error=lambda rc, reason: ModelError(f"llama.cpp could not quantize {src} to {ftype}: {reason}"))
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst
