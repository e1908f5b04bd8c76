"""The model side of the VRAM plan (:mod:`.plan`): what the plan needs of a
GGUF model (:class:`ModelInfo`: layers, heads and head sizes per layer, the
sliding window, the vocabulary and the tensor index), read from its metadata
by :func:`read_model_info` through :mod:`.gguf` (no weight is read). The
plan's exceptions are in :mod:`pyllama_headinfer.errors`.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

from pyllama_headinfer.errors import PlanError, UnsupportedModelError
from pyllama_headinfer.vram.gguf import GGUFArray, GGUFFile, read_gguf

# Architectures whose KV layout this module knows (see read_model_info): a plain
# attention KV cache per layer, or gemma3's iSWA pair. Others (hybrid and
# recurrent memories, MLA, shared-KV layers, per-arch SWA rules) would each
# need their own rules from llama.cpp.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


# --------------------------------------------------------------------------- #
# the model, from its GGUF metadata
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str  # GGML type name, e.g. "F16", "Q4_K"
    ne0: int
    n_bytes: int


@dataclass(frozen=True)
class ModelInfo:
    """What the plan needs of a model, read from its GGUF file (no weights)."""
    path: str
    arch: str
    name: str | None
    n_layer: int  # block_count (llama.cpp's n_layer_all)
    n_layer_nextn: int  # trailing NextN/MTP layers (no KV in the main context)
    n_ctx_train: int
    n_embd: int
    n_vocab: int
    n_head: tuple  # per layer
    n_head_kv: tuple  # per layer
    n_ff: tuple  # per layer
    head_k: int
    head_v: int
    head_k_swa: int
    head_v_swa: int
    n_swa: int  # sliding window (0: none)
    is_swa: tuple  # per layer
    tensors: tuple = field(repr=False)

    @property
    def iswa(self) -> bool:
        return any(self.is_swa)

    def head_k_of(self, il: int) -> int:
        return self.head_k_swa if self.is_swa[il] else self.head_k

    def head_v_of(self, il: int) -> int:
        return self.head_v_swa if self.is_swa[il] else self.head_v

    @property
    def tied_output(self) -> bool:
        return not any(t.name == "output.weight" for t in self.tensors)


def gguf_index(source: str | os.PathLike | GGUFFile) -> tuple[dict, list]:
    """The metadata and the tensor index of a GGUF file (a path, or a
    :class:`GGUFFile` read already), as (key -> value,
    [(name, ggml type id, ne, n_bytes)]), read by
    :func:`pyllama_headinfer.vram.gguf.read_gguf`: string arrays (the
    vocabulary) are skipped over, keeping their length (gguf.GGUFReader builds
    numpy views of every token and needs seconds for a 128k vocabulary; this
    needs milliseconds), and the file is checked as check_gguf checks it
    (ModelError for "not a GGUF" and truncated files)."""
    g = source if isinstance(source, GGUFFile) else read_gguf(source)
    return g.metadata, [(t.name, t.type, t.ne, t.n_bytes) for t in g.tensors]


def _scalar(kv: dict, key: str, default=None):
    v = kv.get(key, default)
    if isinstance(v, GGUFArray):
        raise UnsupportedModelError(f"{key} is an array, expected a single value")
    return v


def _per_layer(kv: dict, key: str, n_layer: int, default=None) -> list | None:
    """llama_model_loader::get_key_or_arr: a scalar for every layer, or an array of exactly n_layer values."""
    v = kv.get(key)
    if v is None:
        return None if default is None else [default] * n_layer
    if isinstance(v, GGUFArray):
        if v.count != n_layer or v.values is None:
            raise PlanError(f"{key} has {v.count} values for {n_layer} layers (llama.cpp refuses this model)")
        return [int(x) for x in v.values]
    return [int(v)] * n_layer


def read_model_info(source: str | os.PathLike | GGUFFile) -> ModelInfo:
    """Read the layers, heads, head sizes, sliding window, vocabulary and the
    tensor index of a GGUF model (a path, or the :class:`GGUFFile` a
    :class:`~pyllama_headinfer.api.model.Model` read already: no second read).
    Raises FileNotFoundError / IsADirectoryError, ModelError (not a GGUF,
    truncated) or UnsupportedModelError."""
    from gguf import GGMLQuantizationType

    if isinstance(source, GGUFFile):
        path = source.path
    else:
        path = Path(os.fspath(source))
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, "model file not found", str(path))
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "model path is a directory", str(path))
        source = path
    meta, gguf_tensors = gguf_index(source)  # a clear ModelError for "not a GGUF" and truncated files

    arch = _scalar(meta, "general.architecture")
    if not arch:
        raise UnsupportedModelError(f"{path} has no general.architecture: not a llama.cpp model")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{path.name}: architecture {arch!r} is not supported by plan (supported: {', '.join(SUPPORTED_ARCHS)}). "
            "Its KV cache layout (sliding-window rules, shared or MLA KV layers, recurrent state) would need "
            "its own rules from llama.cpp; nothing is guessed.")

    def key(k: str) -> str:
        return f"{arch}.{k}"

    n_layer = _scalar(meta, key("block_count"))
    n_embd = _scalar(meta, key("embedding_length"))
    n_ctx_train = _scalar(meta, key("context_length"))
    if not n_layer or not n_embd or n_ctx_train is None:
        raise PlanError(f"{path.name}: {arch}.block_count, .embedding_length or .context_length is missing")
    n_layer, n_embd, n_ctx_train = int(n_layer), int(n_embd), int(n_ctx_train)
    n_nextn = int(_scalar(meta, key("nextn_predict_layers"), 0) or 0)
    if n_nextn > n_layer:
        raise PlanError(f"{path.name}: nextn_predict_layers {n_nextn} > block_count {n_layer}")

    n_head = _per_layer(meta, key("attention.head_count"), n_layer, 0)
    n_head_kv = _per_layer(meta, key("attention.head_count_kv"), n_layer) or list(n_head)
    n_ff = _per_layer(meta, key("feed_forward_length"), n_layer, 0)
    if n_head[0] <= 0:
        raise UnsupportedModelError(f"{path.name}: no attention heads (head_count is 0)")
    head_k = int(_scalar(meta, key("attention.key_length"), n_embd // n_head[0]))
    head_v = int(_scalar(meta, key("attention.value_length"), n_embd // n_head[0]))
    head_k_swa = int(_scalar(meta, key("attention.key_length_swa"), head_k))
    head_v_swa = int(_scalar(meta, key("attention.value_length_swa"), head_v))

    # sliding window: only gemma3 of the supported architectures reads it
    # (src/models/gemma3.cpp: load_swa_pattern(ml, 6), dense_first = false)
    n_swa = 0
    is_swa = [False] * n_layer
    if arch == "gemma3":
        n_swa = int(_scalar(meta, key("attention.sliding_window"), 0) or 0)
        if n_swa > 0:
            pattern = meta.get(key("attention.sliding_window_pattern"))
            if isinstance(pattern, GGUFArray):
                if pattern.values is None:
                    raise PlanError(f"{path.name}: sliding_window_pattern is not an array of numbers")
                values = [bool(x) for x in pattern.values]
                if len(values) > n_layer:
                    raise PlanError(f"{path.name}: sliding_window_pattern has {len(values)} values for {n_layer} layers")
                is_swa = values + [False] * (n_layer - len(values))
            else:
                n_pattern = int(_scalar(meta, key("attention.sliding_window_pattern"), 6))
                n_main = n_layer - n_nextn
                is_swa = [il < n_main and (n_pattern == 0 or il % n_pattern < n_pattern - 1)
                          for il in range(n_layer)]
            if not any(is_swa):
                raise UnsupportedModelError(f"{path.name}: a sliding window of {n_swa} but no SWA layer "
                                            "(llama.cpp asserts on this model)")

    tensors = tuple(TensorInfo(name, GGMLQuantizationType(ttype).name, ne[0] if ne else 1, nbytes)
                    for name, ttype, ne, nbytes in gguf_tensors)
    toks = meta.get("tokenizer.ggml.tokens")
    if isinstance(toks, GGUFArray):
        n_vocab = toks.count
    else:
        emb = [ne for name, _, ne, _ in gguf_tensors if name == "token_embd.weight"]
        n_vocab = int(emb[0][1]) if emb and len(emb[0]) > 1 else 0

    return ModelInfo(path=str(path), arch=arch, name=_scalar(meta, "general.name"), n_layer=n_layer,
                     n_layer_nextn=n_nextn, n_ctx_train=n_ctx_train, n_embd=n_embd, n_vocab=n_vocab,
                     n_head=tuple(n_head), n_head_kv=tuple(n_head_kv), n_ff=tuple(n_ff), head_k=head_k,
                     head_v=head_v, head_k_swa=head_k_swa, head_v_swa=head_v_swa, n_swa=n_swa,
                     is_swa=tuple(is_swa), tensors=tensors)
