"""The synthetic GGUF test models: well-formed, deterministic, and llama.cpp
loads and runs them."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import testing_models as tm

ROOT = Path(__file__).resolve().parents[1]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_generator_is_deterministic(tmp_path, gguf_models):
    again = tm.write_model(tm.SPECS["llama-gqa"], tmp_path / "again.gguf")
    assert sha256(again) == sha256(gguf_models["llama-gqa"])


def test_cache_key_depends_on_spec():
    a = tm.SPECS["llama-gqa"]
    from dataclasses import replace

    assert a.cache_key() != replace(a, seed=a.seed + 1).cache_key()
    assert a.cache_key() == replace(a).cache_key()


@pytest.mark.parametrize("name", sorted(tm.SPECS))
def test_metadata(gguf_models, name):
    import gguf

    spec = tm.SPECS[name]
    path = gguf_models[name]
    assert path.stat().st_size < 32 * 2**20, "test models must stay small"
    reader = gguf.GGUFReader(str(path))

    def field(key):
        f = reader.fields[key]
        return f.contents()

    assert field("general.architecture") == spec.arch
    assert field(f"{spec.arch}.attention.head_count") == spec.n_head
    assert field(f"{spec.arch}.attention.head_count_kv") == spec.n_head_kv
    assert field(f"{spec.arch}.attention.key_length") == spec.head_dim
    assert field(f"{spec.arch}.block_count") == spec.n_layer
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == spec.n_vocab
    names = {t.name for t in reader.tensors}
    for i in range(spec.n_layer):
        for kind in ("attn_q", "attn_k", "attn_v"):
            assert f"blk.{i}.{kind}.weight" in names
            assert (f"blk.{i}.{kind}.bias" in names) == spec.qkv_bias
    if spec.sliding_window:
        assert field(f"{spec.arch}.attention.sliding_window") == spec.sliding_window


def test_spm_vocab_layout():
    v = tm.spm_vocab(512)
    assert v.tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert v.tokens[3] == "<0x00>" and v.tokens[3 + 255] == "<0xFF>"
    assert all(t == 6 for t in v.types[3:259])  # TokenType.BYTE
    assert len(set(v.tokens)) == len(v.tokens) == 512
    # every word piece is reachable by bigram merges: all its prefixes are pieces
    pieces = set(v.tokens)
    for t in v.tokens[259:]:
        if t.startswith(tm.SPM_SPACE) and len(t) > 2 and not t.startswith("<"):
            assert t[:-1] in pieces, t


def test_bpe_vocab_layout():
    v = tm.bpe_vocab(640)
    assert len(v.tokens) == len(set(v.tokens)) == 640
    pieces = set(v.tokens)
    for merge in v.merges:
        a, b = merge.split(" ")
        assert a in pieces and b in pieces and a + b in pieces
    assert v.tokens[v.eos] == "<|endoftext|>"
    assert v.types[v.eos] == 3  # CONTROL


def test_script_writes_models(tmp_path):
    out = tmp_path / "models"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_test_models.py"), "--out", str(out),
                          "--model", "qwen2"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert (out / "qwen2.gguf").is_file()
    assert not (out / "llama-gqa.gguf").exists()


@pytest.mark.parametrize("name", sorted(tm.SPECS))
def test_llama_cpp_loads_and_generates(built, gguf_models, name):
    from pyllama_headinfer.llama import Context, Model

    spec = tm.SPECS[name]
    with Model(gguf_models[name]) as model:
        assert model.n_vocab == spec.n_vocab
        assert model.n_layer == spec.n_layer
        assert model.n_head == spec.n_head
        assert model.n_head_kv == spec.n_head_kv
        assert model.n_embd == spec.n_embd
        if spec.sliding_window:
            assert model.n_swa == spec.sliding_window
        text = "Once upon a time there was a little town by the sea."
        toks = model.tokenize(text, add_special=False)
        assert model.detokenize(toks).strip() == text
        with Context(model, n_ctx=256, n_threads=1) as ctx:
            prompt = model.tokenize(text)
            out = list(ctx.generate(prompt, max_tokens=16, stop_at_eog=False))
            assert len(out) == 16
            assert all(0 <= t < model.n_vocab for t in out)
            assert len(set(out)) > 3, f"degenerate output {out}"
            logits = ctx.logits()
            assert np.isfinite(logits).all()
