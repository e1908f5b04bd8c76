"""Small synthetic GGUF models for tests: real llama.cpp architectures, random
weights from a fixed seed, tiny vocabularies -- a few MB each, loaded and run
by llama.cpp in well under a second on a CPU.

- ``llama-gqa``  : ``llama``, 8 query / 4 KV heads (GQA), head size 64, 3 layers,
  SentencePiece ("llama") tokenizer, F16 matrices.
- ``qwen2``      : ``qwen2`` with q/k/v biases, 8 query / 4 KV heads, head size 64,
  2 layers, byte-level BPE ("gpt2", pre-tokenizer "qwen2") tokenizer, F32.
- ``gemma3-iswa``: ``gemma3``, 8 query / 4 KV heads, head size 64, 4 layers
  alternating sliding-window (16) and global attention, SPM tokenizer,
  F16 matrices (output not tied to the embeddings: with random weights a tied
  output just repeats the last token).

``DRAFT_SPECS`` holds a ``gemma4`` target and its Gemma 4 assistant, the draft
model that reads the target's KV cache (``ensure_draft_models``); ``EXTRA_SPECS``
the models where the split must stay off.

At the pin the tokenizer is independent of the architecture (``qwen2`` would
load with an SPM vocab too); the qwen2 model uses a real byte-level BPE vocab
with merges anyway so that both tokenizer families are exercised.

Head size 64 (not 32) because it is a head size every flash-attention kernel
of llama.cpp supports, including the CUDA ones used by the GPU tests.

Use :func:`write_test_models` (or ``scripts/make_test_models.py --out DIR``) to
write them, :func:`ensure_test_models` for a content-addressed cache (the
pytest fixture).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable

import numpy as np

# Bump when the generator's output changes for the same spec (invalidates caches).
GENERATOR_VERSION = 1

# The testing knob of patch 0011: llama.cpp splits the KV heads of layers it would not split (host memory, devices
# without a pinned host buffer type), so that CI without a GPU runs the whole split path, bit-identical there too.
FORCE_SPLIT = "LLAMA_HEADINFER_FORCE_SPLIT"

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still tell a story.
Once upon a time there was a little town by the sea, and every morning the baker
opened his shop before the sun was up. The people of the town loved his bread,
and the children came to see the warm loaves and the sweet cakes in the window.
One day a stranger walked into the shop and asked for a cup of tea and a piece of
cake. He said that he had come from a land far away, where the mountains touch the
clouds and the rivers run with cold, clear water. The baker listened to his story
and gave him a second piece of cake for free. When the stranger left, he smiled and
said: thank you, my friend, I will remember this town and your kind heart.
Numbers like 1, 2, 3, 10, 42 and 2024 appear in text too; so do questions? Yes!
Memory on the device is small, the host has more: keep some heads here, some there.
"""

SPM_SPACE = "\u2581"  # ▁


class _GeneratedFile:
    """What every model spec shares: its file name and the content key of its
    cache entry (the spec, the corpus and the generator's version)."""

    def cache_key(self) -> str:
        payload = json.dumps({"v": GENERATOR_VERSION, "spec": asdict(self), "corpus": CORPUS}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


@dataclass(frozen=True)
class ModelSpec(_GeneratedFile):
    name: str
    arch: str  # gguf architecture name
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    tokenizer: str  # "spm" or "bpe"
    n_vocab: int
    dtype: str  # "f32" or "f16" (matrices; norms and biases stay f32)
    qkv_bias: bool = False
    tied_output: bool = False
    sliding_window: int = 0  # 0 = no SWA
    swa_pattern: int = 0  # every n-th layer is global (llama.cpp's pattern)
    n_ctx_train: int = 4096
    rope_freq_base: float = 10000.0
    seed: int = 1234



SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(name="llama-gqa", arch="llama", n_layer=3, n_embd=256, n_head=8, n_head_kv=4, head_dim=64,
                  n_ff=512, tokenizer="spm", n_vocab=512, dtype="f16", seed=1001),
        ModelSpec(name="qwen2", arch="qwen2", n_layer=2, n_embd=512, n_head=8, n_head_kv=4, head_dim=64,
                  n_ff=768, tokenizer="bpe", n_vocab=640, dtype="f32", qkv_bias=True,
                  rope_freq_base=1000000.0, seed=1002),
        ModelSpec(name="gemma3-iswa", arch="gemma3", n_layer=4, n_embd=256, n_head=8, n_head_kv=4, head_dim=64,
                  n_ff=512, tokenizer="spm", n_vocab=512, dtype="f16",
                  sliding_window=16, swa_pattern=2, rope_freq_base=1000000.0, seed=1003),
    )
}

# Architectures the HeadInfer equivalence tests cover; gemma3 is for later (iSWA) work.
SPLIT_TEST_MODELS = ("llama-gqa", "qwen2")


# --------------------------------------------------------------------------- #
# tokenizers
# --------------------------------------------------------------------------- #

@dataclass
class Vocab:
    model: str  # "llama" or "gpt2"
    pre: str | None
    tokens: list[str]
    scores: list[float]
    types: list[int]
    merges: list[str]
    bos: int
    eos: int
    unk: int | None
    add_bos: bool
    extra_eog: tuple[int, ...] = ()


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text)


def spm_vocab(n_vocab: int, corpus: str = CORPUS) -> Vocab:
    """SentencePiece-style vocab: <unk> <s> </s>, the 256 byte tokens, single
    characters, then whole words of the corpus with every prefix (llama.cpp's
    SPM tokenizer merges bigrams that are in the vocab, so each step of a word
    has to be a piece)."""
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    scores = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(TokenType.BYTE)
        scores.append(0.0)
    seen = set(tokens)

    def add(piece: str) -> bool:
        if piece in seen or len(tokens) >= n_vocab:
            return False
        seen.add(piece)
        tokens.append(piece)
        types.append(TokenType.NORMAL)
        scores.append(-float(len(tokens)) / 1000.0 + len(piece))  # longer pieces win
        return True

    chars = sorted(set(corpus) - {" ", "\n"})
    add(SPM_SPACE)
    for ch in chars:
        add(ch)
    for ch in chars:
        add(SPM_SPACE + ch)
    counts = Counter(w.lower() for w in _words(corpus))
    counts.update(_words(corpus))
    for word, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        piece = SPM_SPACE + word
        for i in range(2, len(piece) + 1):
            add(piece[:i])
    i = 0
    while len(tokens) < n_vocab:  # pad with unused pieces so n_vocab is exact
        add(f"<unused{i}>")
        types[-1] = TokenType.UNUSED
        i += 1
    return Vocab(model="llama", pre=None, tokens=tokens, scores=scores, types=[int(t) for t in types],
                 merges=[], bos=1, eos=2, unk=0, add_bos=True)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode mapping."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BPE_PRETOKENIZE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")


def bpe_vocab(n_vocab: int, corpus: str = CORPUS) -> Vocab:
    """Byte-level BPE vocab (GPT-2 / Qwen2 style) trained on the corpus: the 256
    byte symbols, learned merges, and the Qwen2 special tokens at the end."""
    from gguf import TokenType

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    seen = set(tokens)
    merges: list[str] = []
    words = Counter(
        tuple(b2u[b] for b in piece.encode("utf-8")) for piece in _BPE_PRETOKENIZE.findall(corpus)
    )
    n_target = n_vocab - len(specials)
    while len(tokens) < n_target:
        pairs: Counter = Counter()
        for word, cnt in words.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] += cnt
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merged = a + b
        merges.append(f"{a} {b}")
        if merged not in seen:
            seen.add(merged)
            tokens.append(merged)
        new_words: Counter = Counter()
        for word, cnt in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += cnt
        words = new_words
    i = 0
    while len(tokens) < n_target:
        tokens.append(f"<|unused{i}|>")
        i += 1
    types = [int(TokenType.NORMAL)] * len(tokens)
    eot = len(tokens)
    tokens += specials
    types += [int(TokenType.CONTROL)] * len(specials)
    return Vocab(model="gpt2", pre="qwen2", tokens=tokens, scores=[], types=types, merges=merges,
                 bos=eot, eos=eot, unk=None, add_bos=False, extra_eog=(eot + 2,))


def vocab_for(spec: ModelSpec) -> Vocab:
    if spec.tokenizer == "spm":
        return spm_vocab(spec.n_vocab)
    if spec.tokenizer == "bpe":
        return bpe_vocab(spec.n_vocab)
    raise ValueError(f"unknown tokenizer {spec.tokenizer!r}")


# --------------------------------------------------------------------------- #
# weights and file
# --------------------------------------------------------------------------- #

def _tensor_name(kind, bid: int | None = None, suffix: str = "weight") -> str:
    import gguf

    base = gguf.TENSOR_NAMES[kind]
    return (base.format(bid=bid) if bid is not None else base) + "." + suffix


def finish_gguf(writer, tmp: Path, path: Path) -> Path:
    """Write what ``writer`` (a ``gguf.GGUFWriter`` opened on ``tmp``) holds,
    then rename ``tmp`` to ``path``: readers never see half a model. A writer
    that splits (``split_max_tensors``), opened on ``tmp / path.name``, writes
    its files, named as gguf-split names them, in the folder ``tmp``; they are
    moved beside ``path``, the first (the one readers open) last, and its path
    is returned."""
    split = Path(writer.path).parent == tmp
    moved: list[Path] = []
    try:
        if split:
            tmp.mkdir()
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if not split:
            os.replace(tmp, path)
            return path
        shards = sorted(tmp.iterdir())
        for shard in reversed(shards):
            target = path.with_name(shard.name)
            os.replace(shard, target)
            moved.append(target)
        moved.clear()
        return path.with_name(shards[0].name)
    finally:
        for shard in moved:  # a failed move leaves no part of the split model
            shard.unlink()
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()


def with_layers(spec: ModelSpec, n_layer: int) -> ModelSpec:
    """``spec`` with another layer count (its own name, so its own file)."""
    return replace(spec, name=f"{spec.name}-{n_layer}l", n_layer=n_layer)


class _RandomWeights:
    """Random tensors from one generator, drawn in the order they are asked for: matrices scaled by 1/sqrt(n_in)
    (numpy shape (rows=n_out, cols=n_in) == ggml ne {n_in, n_out}), norms around 1, biases around 0."""

    def __init__(self, rng: np.random.Generator, mat_dtype) -> None:
        self.rng, self.mat_dtype = rng, mat_dtype

    def mat(self, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(self.mat_dtype)

    def norm(self, n: int) -> np.ndarray:
        return (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32)

    def bias(self, n: int) -> np.ndarray:
        return (0.1 * self.rng.standard_normal(n)).astype(np.float32)


def _add_vocab(w, vocab: Vocab) -> None:
    """The tokenizer's keys of ``vocab`` in the GGUF writer ``w``."""
    w.add_tokenizer_model(vocab.model)
    if vocab.pre:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    if vocab.scores:
        w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    if vocab.unk is not None:
        w.add_unk_token_id(vocab.unk)
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(False)


def write_model(spec: ModelSpec, path: Path, experts: tuple[int, int] | None = None,
                split_max_tensors: int = 0) -> Path:
    """Write ``spec`` as a GGUF file at ``path`` (atomically); return ``path``. ``experts`` (``llama`` only):
    ``(n_expert, n_expert_used)``, a mixture of experts of ``n_ff`` each in every layer instead of its dense FFN
    (not part of the spec: no cached file has them). ``split_max_tensors``: files of at most that many tensors, as
    gguf-split writes them (``<stem>-00001-of-0000N.gguf`` beside ``path``); the first file's path is returned."""
    import gguf
    from gguf import MODEL_TENSOR as T

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    vocab = vocab_for(spec)
    n_vocab = len(vocab.tokens)
    assert n_vocab == spec.n_vocab, (n_vocab, spec.n_vocab)
    mat_dtype = np.float16 if spec.dtype == "f16" else np.float32
    n_q = spec.n_head * spec.head_dim
    n_kv = spec.n_head_kv * spec.head_dim

    weights = _RandomWeights(rng, mat_dtype)
    mat, norm, bias = weights.mat, weights.norm, weights.bias

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    if split_max_tensors:  # the writer names its files after the path it is given: a folder of their own
        w = gguf.GGUFWriter(str(tmp / path.name), spec.arch, split_max_tensors=split_max_tensors)
    else:
        w = gguf.GGUFWriter(str(tmp), spec.arch)
    w.add_name(f"pyllama-headinfer test model {spec.name}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if spec.dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    if experts:
        w.add_expert_count(experts[0])
        w.add_expert_used_count(experts[1])
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(spec.rope_freq_base)
    w.add_layer_norm_rms_eps(1e-6)
    if spec.sliding_window:
        w.add_sliding_window(spec.sliding_window)
        if spec.arch == "gemma4":  # one flag per layer: every swa_pattern-th layer is global
            w.add_sliding_window_pattern([(i + 1) % spec.swa_pattern != 0 for i in range(spec.n_layer)])
            w.add_key_length_swa(spec.head_dim)
            w.add_value_length_swa(spec.head_dim)
            w.add_embedding_length_per_layer_input(0)
        else:
            w.add_sliding_window_pattern(spec.swa_pattern)
        w.add_rope_freq_base_swa(10000.0)

    _add_vocab(w, vocab)

    # gemma scales the input embeddings by sqrt(n_embd): unit-variance rows
    # would drown the layers' contributions
    gemma = spec.arch in ("gemma3", "gemma4")
    emb_std = 1.0 / np.sqrt(spec.n_embd) if gemma else 1.0
    w.add_tensor(_tensor_name(T.TOKEN_EMBD), (emb_std * rng.standard_normal((n_vocab, spec.n_embd))).astype(mat_dtype))
    w.add_tensor(_tensor_name(T.OUTPUT_NORM), norm(spec.n_embd))
    if not spec.tied_output:
        w.add_tensor(_tensor_name(T.OUTPUT), mat(n_vocab, spec.n_embd, gain=3.0))
    for i in range(spec.n_layer):
        w.add_tensor(_tensor_name(T.ATTN_NORM, i), norm(spec.n_embd))
        # larger q/k gain: peaked attention, so every head and position matters
        w.add_tensor(_tensor_name(T.ATTN_Q, i), mat(n_q, spec.n_embd, gain=2.0))
        w.add_tensor(_tensor_name(T.ATTN_K, i), mat(n_kv, spec.n_embd, gain=2.0))
        w.add_tensor(_tensor_name(T.ATTN_V, i), mat(n_kv, spec.n_embd))
        if spec.qkv_bias:
            w.add_tensor(_tensor_name(T.ATTN_Q, i, "bias"), bias(n_q))
            w.add_tensor(_tensor_name(T.ATTN_K, i, "bias"), bias(n_kv))
            w.add_tensor(_tensor_name(T.ATTN_V, i, "bias"), bias(n_kv))
        w.add_tensor(_tensor_name(T.ATTN_OUT, i), mat(spec.n_embd, n_q))
        if gemma:
            w.add_tensor(_tensor_name(T.ATTN_Q_NORM, i), norm(spec.head_dim))
            w.add_tensor(_tensor_name(T.ATTN_K_NORM, i), norm(spec.head_dim))
            w.add_tensor(_tensor_name(T.ATTN_POST_NORM, i), norm(spec.n_embd))
            w.add_tensor(_tensor_name(T.FFN_POST_NORM, i), norm(spec.n_embd))
        w.add_tensor(_tensor_name(T.FFN_NORM, i), norm(spec.n_embd))
        if experts:
            w.add_tensor(_tensor_name(T.FFN_GATE_INP, i), mat(experts[0], spec.n_embd))
            for kind, n_out, n_in in ((T.FFN_GATE_EXP, spec.n_ff, spec.n_embd), (T.FFN_UP_EXP, spec.n_ff, spec.n_embd),
                                      (T.FFN_DOWN_EXP, spec.n_embd, spec.n_ff)):
                w.add_tensor(_tensor_name(kind, i), np.stack([mat(n_out, n_in) for _ in range(experts[0])]))
            continue
        w.add_tensor(_tensor_name(T.FFN_GATE, i), mat(spec.n_ff, spec.n_embd))
        w.add_tensor(_tensor_name(T.FFN_UP, i), mat(spec.n_ff, spec.n_embd))
        w.add_tensor(_tensor_name(T.FFN_DOWN, i), mat(spec.n_embd, spec.n_ff))
    if spec.arch == "gemma4":  # the global layers' proportional RoPE factors (one tensor, shared)
        w.add_tensor(_tensor_name(T.ROPE_FREQS), np.ones(spec.head_dim // 2, dtype=np.float32))

    return finish_gguf(w, tmp, path)


def write_test_models(out_dir: Path, names: Iterable[str] | None = None) -> dict[str, Path]:
    """Write the models named (default: all of :data:`SPECS`) into ``out_dir``."""
    out_dir = Path(out_dir)
    names = list(SPECS) if names is None else list(names)
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        raise ValueError(f"unknown test model(s) {unknown}; known: {sorted(SPECS)}")
    return {n: write_model(SPECS[n], out_dir / SPECS[n].filename) for n in names}


def ensure_test_models(cache_dir: Path, names: Iterable[str] | None = None) -> dict[str, Path]:
    """The test models in a content-addressed cache under ``cache_dir``
    (``<cache_dir>/<spec hash>/<name>.gguf``), generated on first use.  Safe
    when several processes race (each file is written atomically)."""
    return _ensure_cached(SPECS, write_model, cache_dir, names, "test model")


def _ensure_cached(specs: dict, write, cache_dir: Path, names: Iterable[str] | None, what: str) -> dict[str, Path]:
    """``<cache_dir>/<spec hash>/<name>.gguf`` for each spec named (default: all),
    written by ``write(spec, path)`` when missing."""
    cache_dir = Path(cache_dir)
    names = list(specs) if names is None else list(names)
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise ValueError(f"unknown {what}(s) {unknown}; known: {sorted(specs)}")
    out = {}
    for n in names:
        spec = specs[n]
        path = cache_dir / spec.cache_key() / spec.filename
        if not path.is_file():
            write(spec, path)
        out[n] = path
    return out


# --------------------------------------------------------------------------- #
# extra models (appended; the specs above and their cached bytes are unchanged)
# --------------------------------------------------------------------------- #
#
# Models for the cases where the HeadInfer split must stay off:
#
# - ``llama-mqa``   : ``llama`` with a single KV head (MQA), 8 query heads, head
#   size 64, 2 layers: no layer can be split (at least one head on each side).
# - ``jamba-hybrid``: ``jamba``, a hybrid memory (``llama_memory_hybrid``):
#   Mamba layers 0 and 2 (recurrent state), attention layers 1 and 3 with
#   4 query / 2 KV heads of size 64 and no RoPE.  Its attention KV cache lives
#   inside the hybrid memory, which ignores the fraction.
# - ``mamba``       : ``mamba``, 2 Mamba layers, purely recurrent memory.
#
# They are not in :data:`SPECS` (whose every entry is a llama.cpp attention
# model the other tests iterate over); use :func:`ensure_extra_models`.

@dataclass(frozen=True)
class RecurrentSpec(_GeneratedFile):
    """A Mamba (``arch="mamba"``) or Jamba (``arch="jamba"``) model: the layers
    listed in ``attn_layers`` are attention layers (Jamba only), the others
    Mamba layers with ``d_inner = 2 * n_embd`` (llama.cpp supports only that)."""
    name: str
    arch: str  # "mamba" or "jamba"
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ff: int = 0  # jamba: dense FFN after every layer; mamba has none
    attn_layers: tuple = ()
    n_head: int = 0
    n_head_kv: int = 0
    d_conv: int = 4
    d_state: int = 16
    dt_rank: int = 16
    n_ctx_train: int = 4096
    seed: int = 1234


    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head if self.n_head else 0


EXTRA_SPECS: dict = {
    s.name: s
    for s in (
        ModelSpec(name="llama-mqa", arch="llama", n_layer=2, n_embd=256, n_head=8, n_head_kv=1, head_dim=64,
                  n_ff=512, tokenizer="spm", n_vocab=512, dtype="f16", seed=1011),
        RecurrentSpec(name="jamba-hybrid", arch="jamba", n_layer=4, n_embd=256, n_vocab=512, n_ff=512,
                      attn_layers=(1, 3), n_head=4, n_head_kv=2, seed=1012),
        RecurrentSpec(name="mamba", arch="mamba", n_layer=2, n_embd=256, n_vocab=512, seed=1013),
    )
}


# A target and the draft model that shares its KV cache (a context with ``ctx_other``): the target ``gemma4`` (layers
# 0-3 sliding, 4 global; 4 KV heads of 64, every layer splits) and its Gemma 4 assistant, which attends to the
# target's layers 3 and 4. Not in EXTRA_SPECS: the assistant runs only beside its target.
@dataclass(frozen=True)
class AssistantSpec(_GeneratedFile):
    """A Gemma 4 assistant (``arch="gemma4-assistant"``, the draft model of multi-token prediction) for the
    ``gemma4`` model ``target``: it has no KV cache of its own, its layers attend to the target's last sliding
    (layer 0) and last global layer (layer 1), so it needs the target's head count and sizes; its input is the
    target's token embedding joined with the target's last hidden state."""
    name: str
    target: str  # the name of its gemma4 ModelSpec in DRAFT_SPECS
    n_embd: int
    n_head: int
    n_ff: int
    seed: int = 1234


DRAFT_SPECS: dict = {
    s.name: s
    for s in (
        ModelSpec(name="gemma4-iswa", arch="gemma4", n_layer=5, n_embd=256, n_head=8, n_head_kv=4, head_dim=64,
                  n_ff=512, tokenizer="spm", n_vocab=512, dtype="f16", sliding_window=16, swa_pattern=5,
                  rope_freq_base=1000000.0, seed=1015),
        AssistantSpec(name="gemma4-assistant", target="gemma4-iswa", n_embd=128, n_head=4, n_ff=256, seed=1016),
    )
}


# Too big for the test suite (~216 MB): only scripts/gpu_check.py writes them.
GPU_SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        # Llama-3-8B's attention geometry (32 query heads, 8 KV heads of 128, n_embd 4096) in 2 layers: the GPU
        # check runs the split on the real head shapes without writing an 8B model
        ModelSpec(name="llama-8b-heads", arch="llama", n_layer=2, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128,
                  n_ff=1024, tokenizer="spm", n_vocab=512, dtype="f16", rope_freq_base=500000.0, seed=1014),
    )
}


def ensure_gpu_models(cache_dir: Path, names: Iterable[str] | None = None) -> dict[str, Path]:
    """Like :func:`ensure_test_models`, for :data:`GPU_SPECS`."""
    return _ensure_cached(GPU_SPECS, write_model, cache_dir, names, "GPU check model")


def write_recurrent_model(spec: RecurrentSpec, path: Path) -> Path:
    """Write a :class:`RecurrentSpec` as a GGUF file at ``path`` (atomically), F32 weights."""
    import gguf
    from gguf import MODEL_TENSOR as T

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    vocab = spm_vocab(spec.n_vocab)
    n_vocab = len(vocab.tokens)
    d_inner = 2 * spec.n_embd

    weights = _RandomWeights(rng, np.float32)
    mat, norm = weights.mat, weights.norm

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), spec.arch)
    w.add_name(f"pyllama-headinfer test model {spec.name}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv([spec.n_head_kv if i in spec.attn_layers else 0 for i in range(spec.n_layer)]
                        if spec.attn_layers else 0)
    w.add_ssm_conv_kernel(spec.d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(spec.d_state)
    w.add_ssm_time_step_rank(spec.dt_rank)
    w.add_layer_norm_rms_eps(1e-6)

    _add_vocab(w, vocab)

    w.add_tensor(_tensor_name(T.TOKEN_EMBD), rng.standard_normal((n_vocab, spec.n_embd)).astype(np.float32))
    w.add_tensor(_tensor_name(T.OUTPUT_NORM), norm(spec.n_embd))
    w.add_tensor(_tensor_name(T.OUTPUT), mat(n_vocab, spec.n_embd, gain=3.0))
    n_kv = spec.n_head_kv * spec.head_dim
    for i in range(spec.n_layer):
        w.add_tensor(_tensor_name(T.ATTN_NORM, i), norm(spec.n_embd))
        if i in spec.attn_layers:
            w.add_tensor(_tensor_name(T.ATTN_Q, i), mat(spec.n_embd, spec.n_embd, gain=2.0))
            w.add_tensor(_tensor_name(T.ATTN_K, i), mat(n_kv, spec.n_embd, gain=2.0))
            w.add_tensor(_tensor_name(T.ATTN_V, i), mat(n_kv, spec.n_embd))
            w.add_tensor(_tensor_name(T.ATTN_OUT, i), mat(spec.n_embd, spec.n_embd))
        else:
            # ggml shapes (ne) reversed: ssm_in {n_embd, 2*d_inner}, conv1d {d_conv, d_inner}, ...
            w.add_tensor(_tensor_name(T.SSM_IN, i), mat(2 * d_inner, spec.n_embd))
            w.add_tensor(_tensor_name(T.SSM_CONV1D, i),
                         (rng.standard_normal((d_inner, spec.d_conv)) / np.sqrt(spec.d_conv)).astype(np.float32))
            w.add_tensor(_tensor_name(T.SSM_CONV1D, i, "bias"), (0.1 * rng.standard_normal(d_inner)).astype(np.float32))
            w.add_tensor(_tensor_name(T.SSM_X, i), mat(spec.dt_rank + 2 * spec.d_state, d_inner))
            w.add_tensor(_tensor_name(T.SSM_DT, i), mat(d_inner, spec.dt_rank))
            w.add_tensor(_tensor_name(T.SSM_DT, i, "bias"), (-2.0 + 0.5 * rng.standard_normal(d_inner)).astype(np.float32))
            if spec.arch == "jamba":
                w.add_tensor(_tensor_name(T.SSM_DT_NORM, i), norm(spec.dt_rank))
                w.add_tensor(_tensor_name(T.SSM_B_NORM, i), norm(spec.d_state))
                w.add_tensor(_tensor_name(T.SSM_C_NORM, i), norm(spec.d_state))
            # A = -exp(A_log) with the usual A_log = log(1..d_state); D = 1 (no "weight" suffix)
            a = -np.tile(np.arange(1, spec.d_state + 1, dtype=np.float32), (d_inner, 1))
            w.add_tensor(gguf.TENSOR_NAMES[T.SSM_A].format(bid=i), a)
            w.add_tensor(gguf.TENSOR_NAMES[T.SSM_D].format(bid=i), np.ones(d_inner, dtype=np.float32))
            w.add_tensor(_tensor_name(T.SSM_OUT, i), mat(spec.n_embd, d_inner))
        if spec.n_ff:
            w.add_tensor(_tensor_name(T.FFN_NORM, i), norm(spec.n_embd))
            w.add_tensor(_tensor_name(T.FFN_GATE, i), mat(spec.n_ff, spec.n_embd))
            w.add_tensor(_tensor_name(T.FFN_UP, i), mat(spec.n_ff, spec.n_embd))
            w.add_tensor(_tensor_name(T.FFN_DOWN, i), mat(spec.n_embd, spec.n_ff))

    return finish_gguf(w, tmp, path)


def write_assistant_model(spec: AssistantSpec, path: Path) -> Path:
    """Write an :class:`AssistantSpec` as a GGUF file at ``path`` (atomically), F16 matrices."""
    import gguf
    from gguf import MODEL_TENSOR as T

    target = DRAFT_SPECS[spec.target]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    vocab = vocab_for(target)
    hd = target.head_dim

    weights = _RandomWeights(rng, np.float16)
    mat, norm = weights.mat, weights.norm

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "gemma4-assistant")
    w.add_name(f"pyllama-headinfer test model {spec.name}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(target.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_embedding_length_out(target.n_embd)
    w.add_block_count(2)
    w.add_nextn_predict_layers(2)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(target.n_head_kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_key_length_swa(hd)
    w.add_value_length_swa(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(target.rope_freq_base)
    w.add_rope_freq_base_swa(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(target.sliding_window)
    w.add_sliding_window_pattern([True, False])
    _add_vocab(w, vocab)

    w.add_tensor(_tensor_name(T.TOKEN_EMBD),
                 (rng.standard_normal((len(vocab.tokens), spec.n_embd)) / np.sqrt(spec.n_embd)).astype(np.float16))
    w.add_tensor(_tensor_name(T.OUTPUT_NORM), norm(spec.n_embd))
    # llama.cpp's names (this gguf package has no constants for them)
    w.add_tensor("nextn.pre_projection.weight", mat(spec.n_embd, 2 * target.n_embd))
    w.add_tensor("nextn.post_projection.weight", mat(target.n_embd, spec.n_embd))
    for i in range(2):
        w.add_tensor(_tensor_name(T.ATTN_NORM, i), norm(spec.n_embd))
        w.add_tensor(_tensor_name(T.ATTN_Q, i), mat(spec.n_head * hd, spec.n_embd, gain=2.0))
        w.add_tensor(_tensor_name(T.ATTN_OUT, i), mat(spec.n_embd, spec.n_head * hd))
        w.add_tensor(_tensor_name(T.ATTN_Q_NORM, i), norm(hd))
        w.add_tensor(_tensor_name(T.ATTN_POST_NORM, i), norm(spec.n_embd))
        w.add_tensor(_tensor_name(T.LAYER_OUT_SCALE, i), np.ones(1, dtype=np.float32))
        w.add_tensor(_tensor_name(T.FFN_NORM, i), norm(spec.n_embd))
        w.add_tensor(_tensor_name(T.FFN_GATE, i), mat(spec.n_ff, spec.n_embd))
        w.add_tensor(_tensor_name(T.FFN_UP, i), mat(spec.n_ff, spec.n_embd))
        w.add_tensor(_tensor_name(T.FFN_DOWN, i), mat(spec.n_embd, spec.n_ff))
        w.add_tensor(_tensor_name(T.FFN_POST_NORM, i), norm(spec.n_embd))
    w.add_tensor(_tensor_name(T.ROPE_FREQS), np.ones(hd // 2, dtype=np.float32))
    return finish_gguf(w, tmp, path)


def write_extra_model(spec, path: Path) -> Path:
    if isinstance(spec, RecurrentSpec):
        return write_recurrent_model(spec, path)
    if isinstance(spec, AssistantSpec):
        return write_assistant_model(spec, path)
    return write_model(spec, path)


def ensure_extra_models(cache_dir: Path, names: Iterable[str] | None = None) -> dict[str, Path]:
    """Like :func:`ensure_test_models`, for :data:`EXTRA_SPECS`."""
    return _ensure_cached(EXTRA_SPECS, write_extra_model, cache_dir, names, "extra test model")


def ensure_draft_models(cache_dir: Path) -> dict[str, Path]:
    """Like :func:`ensure_test_models`, for :data:`DRAFT_SPECS`."""
    return _ensure_cached(DRAFT_SPECS, write_extra_model, cache_dir, None, "draft test model")
