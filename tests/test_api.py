"""The Python API (pyllama_headinfer.llama): models, contexts, samplers,
memory and state, and the checked errors (each leaves a live interpreter)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from testing_models import CORPUS, FORCE_SPLIT


@pytest.fixture(scope="module")
def model(llama, gguf_models):
    with llama.Model(gguf_models["llama-gqa"]) as m:
        yield m


@pytest.fixture
def ctx(llama, model):
    with llama.Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1) as c:
        yield c


def prompt_tokens(model, n=40):
    toks = model.tokenize(CORPUS)
    assert len(toks) >= n
    return toks[:n]


def alive(llama, model):
    """The interpreter and the library still work."""
    with llama.Context(model, n_ctx=64, n_threads=1) as c:
        c.decode(model.tokenize("hello"))
        assert np.isfinite(c.logits()).all()


# --------------------------------------------------------------------------
# model


def test_model_properties(model):
    assert model.n_vocab == 512
    assert model.n_head_kv == 4 and model.n_head == 8 and model.n_layer == 3
    assert model.n_ctx_train == 4096
    assert model.size > 0 and model.n_params > 0
    assert "llama" in model.description
    assert model.meta("general.architecture") == "llama"
    assert model.meta("no.such.key") is None
    assert model.token_bos == 1 and model.token_eos == 2
    assert model.is_eog(2) and not model.is_eog(300)


def test_tokenize_roundtrip(model):
    text = "The baker listened to his story."
    toks = model.tokenize(text)
    assert toks[0] == model.token_bos
    assert model.tokenize(text, add_special=False) == toks[1:]
    # llama.cpp keeps the SPM space prefix when it drops BOS; without BOS it strips it
    assert model.detokenize(toks) == " " + text
    assert model.detokenize(toks[1:]) == text
    assert b"".join(model.token_to_piece(t) for t in toks[1:]).decode().strip() == text
    assert model.tokenize("") == [model.token_bos]
    # bytes outside the vocabulary fall back to byte tokens
    emoji = "caf\u00e9 \U0001F600"
    assert model.detokenize(model.tokenize(emoji, add_special=False)).strip() == emoji


def test_missing_model(llama, model, tmp_path):
    with pytest.raises(FileNotFoundError, match="model file not found"):
        llama.Model(tmp_path / "nope.gguf")
    alive(llama, model)


@pytest.mark.parametrize("damage", ["truncated", "truncated_header", "not_gguf", "empty", "garbage_after_magic",
                                    "bad_version"])
def test_corrupt_model(llama, model, gguf_models, tmp_path, damage):
    data = gguf_models["llama-gqa"].read_bytes()
    bad = {
        "truncated": data[: len(data) // 2],
        "truncated_header": data[:100],
        "not_gguf": b"this is a text file, not a model\n" * 10,
        "empty": b"",
        "garbage_after_magic": b"GGUF" + bytes([3, 0, 0, 0]) + bytes(range(256)) * 8,
        "bad_version": data[:4] + (99).to_bytes(4, "little") + data[8:],
    }[damage]
    path = tmp_path / f"{damage}.gguf"
    path.write_bytes(bad)
    with pytest.raises(llama.ModelError):
        llama.Model(path)
    alive(llama, model)


def test_check_gguf_accepts_test_models(llama, gguf_models):
    for path in gguf_models.values():
        info = llama.check_gguf(path)
        assert info["n_tensors"] > 0 and info["data_offset"] < info["file_size"]


# --------------------------------------------------------------------------
# context parameters


@pytest.mark.parametrize("frac", [float("nan"), -0.01, 1.01, 2, -1, "0.5", True, float("inf")])
def test_bad_headinfer_frac(llama, model, frac, caplog):
    caplog.set_level(logging.DEBUG, logger="pyllama_headinfer.llama")
    with pytest.raises(ValueError, match="headinfer_gpu_heads_frac") as info:
        llama.Context(model, n_ctx=64, headinfer_gpu_heads_frac=frac)
    assert repr(frac) in str(info.value) or str(frac) in str(info.value)
    # rejected in Python: llama.cpp never saw it (it would log the context setup)
    assert not [r for r in caplog.records if r.name == "pyllama_headinfer.llama"]
    alive(llama, model)


@pytest.mark.parametrize("frac", [0, 0.0, 0.5, 1, 1.0, np.float32(0.25)])
def test_good_headinfer_frac(llama, model, frac):
    with llama.Context(model, n_ctx=64, n_threads=1, headinfer_gpu_heads_frac=frac) as c:
        assert c.headinfer_gpu_heads_frac == float(frac)


def test_bad_context_params(llama, model):
    with pytest.raises(ValueError, match="type_k"):
        llama.Context(model, type_k="f8")
    with pytest.raises(ValueError, match="n_batch"):
        llama.Context(model, n_batch=0)
    with pytest.raises(ValueError, match="n_ctx"):
        llama.Context(model, n_ctx=-5)


def test_context_properties(ctx):
    assert ctx.n_ctx == 256 and ctx.n_batch == 64 and ctx.n_seq_max == 1
    assert ctx.n_tokens() == 0 and ctx.seq_pos_max() == -1


# --------------------------------------------------------------------------
# decoding and logits


def test_token_out_of_range(llama, model, ctx):
    for bad in ([model.n_vocab], [5, -1], [1, 2, 10**9]):
        with pytest.raises(llama.TokenError, match="out of range"):
            ctx.decode(bad)
    with pytest.raises(llama.TokenError):
        model.detokenize([model.n_vocab + 3])
    with pytest.raises(llama.TokenError):
        model.token_to_piece(-2)
    assert ctx.n_tokens() == 0  # nothing reached llama.cpp
    ctx.decode([1, 2, 3])
    assert ctx.n_tokens() == 3


def test_prompt_longer_than_context(llama, model):
    with llama.Context(model, n_ctx=256, n_batch=64, n_threads=1) as c:
        n = c.n_ctx
        with pytest.raises(llama.ContextOverflowError, match=f"n_ctx={n}"):
            c.decode([5] * (n + 1))
        assert c.n_tokens() == 0
        c.decode([5] * (n - 2))
        with pytest.raises(llama.ContextOverflowError):
            c.decode([5, 6, 7])
        # generation stops when the context is full
        out = list(c.generate([5] * (n - 4), max_tokens=100, stop_at_eog=False))
        assert len(out) == 4 + 1
        assert c.n_tokens() == n
    alive(llama, model)


def test_empty_decode(ctx):
    with pytest.raises(ValueError):
        ctx.decode([])


def test_logits_modes(llama, model, ctx):
    toks = prompt_tokens(model, 40)
    with pytest.raises(ValueError, match="no logits"):
        ctx.logits()
    ctx.decode(toks, logits="all")
    all_rows = np.stack([ctx.logits(i) for i in range(len(toks))])
    assert np.array_equal(all_rows[-1], ctx.logits(-1))
    with pytest.raises(IndexError):
        ctx.logits(len(toks))
    ctx.clear()
    ctx.decode(toks, logits="last")
    np.testing.assert_allclose(ctx.logits(), all_rows[-1], rtol=1e-4, atol=1e-4)
    with pytest.raises(IndexError, match="only the last token"):
        ctx.logits(0)
    ctx.clear()
    ctx.decode(toks, logits="none")
    with pytest.raises(ValueError, match="no logits"):
        ctx.logits()


def test_logits_all_over_several_batches(llama, model):
    toks = prompt_tokens(model, 40)
    with llama.Context(model, n_ctx=128, n_batch=16, n_ubatch=16, n_threads=1) as small, \
            llama.Context(model, n_ctx=128, n_batch=64, n_ubatch=16, n_threads=1) as big:
        small.decode(toks, logits="all")
        big.decode(toks, logits="all")
        for i in (0, 15, 16, 31, 39, -1):
            np.testing.assert_array_equal(small.logits(i), big.logits(i))
        assert small.n_tokens() == 40


def test_logits_copy_and_view(model, ctx):
    toks = prompt_tokens(model, 10)
    ctx.decode(toks)
    copy = ctx.logits()
    view = ctx.logits(copy=False)
    assert np.array_equal(copy, view)
    assert not view.flags.owndata
    ctx.decode([300])
    assert np.array_equal(view, ctx.logits())  # the view follows llama.cpp's buffer
    assert not np.array_equal(copy, ctx.logits())  # the copy does not


def test_decode_failure_code_is_an_exception(llama, model):
    """llama_decode errors (here: the batch spans positions the KV cache can't
    hold because n_ctx_seq is smaller than claimed) become DecodeError -- we
    force one by a batch with an invalid sequence id going around the check."""
    with llama.Context(model, n_ctx=64, n_threads=1) as c:
        c.decode([1, 2, 3])
        c.n_seq_max = 4  # lie about the sequence count: llama.cpp rejects the batch
        with pytest.raises(llama.DecodeError) as info:
            c.decode([4, 5], seq_id=3)
        assert info.value.code != 0
    alive(llama, model)


# --------------------------------------------------------------------------
# sampling and generation


def test_greedy_is_argmax(llama, model, ctx):
    toks = prompt_tokens(model, 20)
    ctx.decode(toks)
    with llama.Sampler.greedy() as s:
        assert s.sample(ctx) == int(np.argmax(ctx.logits()))


def test_generate_matches_manual_greedy(llama, model, ctx):
    toks = prompt_tokens(model, 20)
    gen = list(ctx.generate(toks, 12, stop_at_eog=False))
    ctx.clear()
    ctx.decode(toks)
    manual = []
    for _ in range(12):
        t = int(np.argmax(ctx.logits()))
        manual.append(t)
        ctx.decode([t])
    assert gen == manual


def test_seeded_sampling_is_reproducible(llama, model, ctx):
    toks = prompt_tokens(model, 20)
    runs = []
    for seed in (7, 7, 8):
        with llama.Sampler.random(temperature=1.5, top_k=100, top_p=0.99, min_p=0.0, seed=seed) as s:
            assert s.seed == seed
            runs.append(list(ctx.generate(toks, 16, s, stop_at_eog=False)))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_sampler_builder(llama, ctx, model):
    s = llama.Sampler().add_top_k(10).add_top_p(0.9).add_min_p(0.01).add_temp(0.7).add_dist(seed=3)
    assert s.stages == ["top_k", "top_p", "min_p", "temp", "dist"]
    with pytest.raises(ValueError, match="after the selecting stage"):
        s.add_greedy()
    assert llama.Sampler.from_params(temperature=0).stages == ["greedy"]
    incomplete = llama.Sampler().add_top_k(5)
    ctx.decode(prompt_tokens(model, 5))
    with pytest.raises(ValueError, match="selecting stage"):
        incomplete.sample(ctx)
    with pytest.raises(ValueError):
        llama.Sampler().add_top_p(1.5)
    s.close()
    with pytest.raises(llama.ClosedError):
        s.sample(ctx)


def test_sample_without_logits_does_not_abort(llama, model, ctx):
    with llama.Sampler.greedy() as s:
        with pytest.raises(ValueError, match="no logits"):
            s.sample(ctx)
        ctx.decode(prompt_tokens(model, 5), logits="none")
        with pytest.raises(ValueError, match="no logits"):
            s.sample(ctx)
    alive(llama, model)


def test_complete(ctx):
    out = ctx.complete("Once upon a time", max_tokens=8)
    assert isinstance(out, str) and out


# --------------------------------------------------------------------------
# memory


def test_seq_rm_and_redecode(model, ctx):
    toks = prompt_tokens(model, 30)
    ctx.decode(toks)
    ref = ctx.logits()
    assert ctx.seq_rm(0, 20, -1)
    assert ctx.n_tokens() == 20
    ctx.decode(toks[20:])
    np.testing.assert_array_equal(ctx.logits(), ref)
    assert ctx.seq_rm(0)  # whole sequence
    assert ctx.n_tokens() == 0


def test_seq_cp_across_streams(llama, model):
    """Non-unified KV cache: seq_cp copies the data between per-sequence streams."""
    toks = prompt_tokens(model, 24)
    with llama.Context(model, n_ctx=512, n_seq_max=2, kv_unified=False, n_threads=1) as c:
        c.decode(toks[:20], seq_id=0)
        c.seq_cp(0, 1)
        assert c.n_tokens(1) == 20
        c.decode(toks[20:], seq_id=1)
        on_copy = c.logits()
        c.decode(toks[20:], seq_id=0)
        np.testing.assert_array_equal(c.logits(), on_copy)
        with pytest.raises(ValueError, match="n_seq_max=2"):
            c.decode([5], seq_id=2)
        with pytest.raises(ValueError):
            c.seq_cp(0, 5)


def test_seq_cp_keep_unified(llama, model):
    toks = prompt_tokens(model, 24)
    with llama.Context(model, n_ctx=256, n_seq_max=2, kv_unified=True, n_threads=1) as c:
        c.decode(toks[:20], seq_id=0)
        c.seq_cp(0, 1)
        c.decode(toks[20:], seq_id=1)
        on_copy = c.logits()
        c.decode(toks[20:], seq_id=0)
        np.testing.assert_array_equal(c.logits(), on_copy)
        c.seq_keep(1)
        assert c.n_tokens(0) == 0 and c.n_tokens(1) == 24


def test_seq_add_div(llama, model, ctx):
    ctx.decode(prompt_tokens(model, 16))
    ctx.seq_add(0, 0, -1, 4)
    assert ctx.seq_pos_max() == 19 and ctx.seq_pos_min() == 4
    ctx.seq_div(0, 0, -1, 2)
    assert ctx.seq_pos_max() == 9
    with pytest.raises(ValueError):
        ctx.seq_div(0, 0, -1, 0)


def test_clear(model, ctx):
    ctx.decode(prompt_tokens(model, 8))
    ctx.clear()
    assert ctx.n_tokens() == 0


# --------------------------------------------------------------------------
# state


def test_state_roundtrip(llama, model, ctx):
    """A state holds the KV cache and the logits: save one token early,
    decode the last prompt token after loading -- or save at the end and
    sample right away (test_state_keeps_the_logits)."""
    toks = prompt_tokens(model, 30)
    ctx.decode(toks[:-1])
    early = ctx.logits()
    state = ctx.save_state()
    assert isinstance(state, bytes) and len(state) > 1000
    first = list(ctx.generate(toks, 8, reset=True, stop_at_eog=False))
    ctx.clear()
    ctx.load_state(state)
    assert ctx.n_tokens() == 29
    np.testing.assert_array_equal(ctx.logits(), early)
    ctx.decode(toks[-1:])
    np.testing.assert_array_equal(ctx.logits(), _logits_after(llama, model, toks))
    cont = []
    with llama.Sampler.greedy() as s:
        for _ in range(8):
            t = s.sample(ctx)
            cont.append(t)
            ctx.decode([t])
    assert cont == first


def _logits_after(llama, model, toks):
    """Logits after decoding toks[:-1] then toks[-1] in a fresh context (same batch shapes)."""
    with llama.Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1) as c:
        c.decode(toks[:-1])
        c.decode(toks[-1:])
        return c.logits()


def test_state_file_roundtrip(llama, model, ctx, tmp_path):
    toks = prompt_tokens(model, 25)
    ctx.decode(toks)
    ref = ctx.logits()
    path = tmp_path / "state.bin"
    ctx.save_state_file(path, toks)
    assert path.stat().st_size > 0
    with llama.Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1) as other:
        assert other.load_state_file(path) == toks
        assert other.n_tokens() == 25
        np.testing.assert_array_equal(other.logits(), ref)
        other.decode([300])
        ctx.decode([300])
        np.testing.assert_array_equal(other.logits(), ctx.logits())
    with pytest.raises(FileNotFoundError):
        ctx.load_state_file(tmp_path / "missing.bin")


def _greedy(llama, ctx, n=10):
    """n greedy tokens from the context's logits, with the logits each was sampled from."""
    tokens, logits = [], []
    with llama.Sampler.greedy() as s:
        for _ in range(n):
            logits.append(ctx.logits())
            tokens.append(s.sample(ctx))
            ctx.decode(tokens[-1:])
    return tokens, logits


@pytest.mark.parametrize("how", ["bytes", "file"])
@pytest.mark.parametrize("save_frac,load_frac", [(1.0, 0.5), (0.5, 1.0)])
def test_state_keeps_the_logits(llama, model, tmp_path, monkeypatch, how, save_frac, load_frac):
    """After a state load, logits() gives the logits the context had when the state was
    saved, bit for bit -- in a fresh context, at another fraction -- and greedy decoding
    continues exactly as it would have without the save (llama.cpp's state at the pin
    holds no logits: the API carries them in a block after llama.cpp's data)."""
    monkeypatch.setenv(FORCE_SPLIT, "1")
    toks = prompt_tokens(model, 30)
    kw = dict(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1)
    path = tmp_path / "state.bin"
    with llama.Context(model, headinfer_gpu_heads_frac=save_frac, **kw) as c:
        c.decode(toks)
        saved = c.logits()
        state = c.save_state() if how == "bytes" else c.save_state_file(path, toks)
        expected = _greedy(llama, c)
    with llama.Context(model, headinfer_gpu_heads_frac=load_frac, **kw) as c:
        layers = c.kv_residency()["layers"]
        assert any(x["n_head_resident"] < x["n_head_kv"] for x in layers) == (load_frac < 1.0)
        if how == "bytes":
            c.load_state(state)
        else:
            assert c.load_state_file(path) == toks
        got = c.logits()
        assert got.tobytes() == saved.tobytes(), f"max |diff| {np.abs(got - saved).max()}"
        view = c.logits(copy=False)
        assert view.tobytes() == saved.tobytes() and not view.flags.writeable
        with pytest.raises(IndexError, match="only the last token"):
            c.logits(0)
        tokens, logits = _greedy(llama, c)
    assert tokens == expected[0]
    for step, (x, y) in enumerate(zip(logits, expected[1])):
        assert x.tobytes() == y.tobytes(), f"step {step}"


def test_state_keeps_seeded_sampling(llama, model):
    """A seeded random sampler draws the same tokens from restored logits as from llama.cpp's buffer."""
    toks = prompt_tokens(model, 20)
    runs = []
    with llama.Context(model, n_ctx=256, n_threads=1) as c:
        c.decode(toks)
        state = c.save_state()
        for _ in range(2):
            c.load_state(state)  # the second time in a context whose buffer moved on: the state's logits
            with llama.Sampler.random(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7) as s:
                out = []
                for _ in range(8):
                    out.append(s.sample(c))
                    c.decode(out[-1:])
            runs.append(out)
    with llama.Context(model, n_ctx=256, n_threads=1) as c, \
            llama.Sampler.random(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7) as s:
        c.decode(toks)
        out = []
        for _ in range(8):
            out.append(s.sample(c))
            c.decode(out[-1:])
    assert runs[0] == runs[1] == out


@pytest.mark.parametrize("how", ["bytes", "file"])
def test_state_keeps_all_and_batch_logits(llama, model, tmp_path, how):
    """logits='all' (one batch and several) and decode_batch() rows come back with their indices."""
    toks = prompt_tokens(model, 40)
    kw = dict(n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=2, n_threads=1)

    def roundtrip(c):
        if how == "bytes":
            state = c.save_state()
            with llama.Context(model, **kw) as other:
                other.load_state(state)
                yield other
        else:
            c.save_state_file(tmp_path / "s.bin", [])
            with llama.Context(model, **kw) as other:
                other.load_state_file(tmp_path / "s.bin")
                yield other

    with llama.Context(model, **kw) as c:
        for n in (20, 40):  # 40 > n_batch: collected over two batches
            c.clear()
            c.decode(toks[:n], logits="all")
            rows = [c.logits(i) for i in range(-n, n)]
            for other in roundtrip(c):
                assert all(other.logits(i).tobytes() == r.tobytes() for i, r in zip(range(-n, n), rows))
                with pytest.raises(IndexError):
                    other.logits(n)
        c.clear()
        at = c.decode_batch({0: toks[:5], 1: toks[5:12]})
        rows = {i: c.logits(i) for i in at.values()}
        for other in roundtrip(c):
            assert all(other.logits(i).tobytes() == r.tobytes() for i, r in rows.items())
            with pytest.raises(IndexError, match="decode_batch"):
                other.logits(0)
            with llama.Sampler.greedy() as g, llama.Sampler.greedy() as h:
                assert g.sample(other, at[1]) == h.sample(c, at[1])


def test_state_without_logits_says_which_call_continues(llama, model, ctx, tmp_path):
    toks = prompt_tokens(model, 20)
    ctx.decode(toks, logits="none")
    plain = ctx.save_state()
    ctx.decode([300])
    no_block = ctx.save_state(logits=False)
    ctx.save_state_file(tmp_path / "plain.bin", toks, logits=False)
    for load in (lambda c: c.load_state(plain), lambda c: c.load_state(no_block),
                 lambda c: c.load_state_file(tmp_path / "plain.bin")):
        with llama.Context(model, n_ctx=256, n_threads=1) as c:
            load(c)
            with pytest.raises(ValueError, match=r"the loaded state holds none.*seq_rm"):
                c.logits()
    # logits=False is llama.cpp's state exactly: what its own calls write
    lib, ffi = ctx._lib, ctx._ffi
    size = int(lib.llama_state_get_size(ctx._ptr()))
    buf = ffi.new("uint8_t[]", size)
    assert ffi.buffer(buf, int(lib.llama_state_get_data(ctx._ptr(), buf, size)))[:] == no_block


def test_state_block_follows_llama_cpps_data(llama, model, ctx):
    """llama.cpp's own llama_state_set_data reads its part of the bytes and stops before the
    block; the API refuses bytes that are more than one state (or a state cut in its block)."""
    toks = prompt_tokens(model, 20)
    ctx.decode(toks)
    state, plain = ctx.save_state(), ctx.save_state(logits=False)
    assert state.startswith(plain) and len(state) > len(plain) + 4 * model.n_vocab
    lib, ffi = ctx._lib, ctx._ffi
    with llama.Context(model, n_ctx=256, n_threads=1) as c:
        assert int(lib.llama_state_set_data(c._ptr(), ffi.from_buffer("uint8_t[]", state), len(state))) == len(plain)
        for bad in (plain + b"\0" * 64, state[:-1], state[:-100], state + b"x"):
            c.decode(toks[:5])
            with pytest.raises(llama.StateError):
                c.load_state(bad)
            assert c.n_tokens() == 0
            with pytest.raises(ValueError, match="no logits"):
                c.logits()


def test_seq_state_load_says_which_call_continues(llama, model, tmp_path):
    """A sequence's state is llama.cpp's, without logits: logits() says how to continue."""
    toks = prompt_tokens(model, 20)
    with llama.Context(model, n_ctx=256, n_seq_max=2, n_threads=1) as c:
        c.decode(toks, seq_id=0)
        data = c.save_seq_state(0)
        c.save_seq_state_file(tmp_path / "seq.bin", 0, toks)
        assert c.seq_rm(0, 19, -1)
        c.decode(toks[-1:], seq_id=0)
        ref = c.logits()  # the last token decoded again, as in sequence 1 below (its own KV stream)
        for load in (lambda: c.load_seq_state(data, 1), lambda: c.load_seq_state_file(tmp_path / "seq.bin", 1)):
            load()
            with pytest.raises(ValueError, match=r"sequence's state holds its KV cells only.*seq_rm"):
                c.logits()
            assert c.seq_rm(1, 19, -1)  # what the message says: drop the last position, decode it again
            c.decode(toks[-1:], seq_id=1)
            np.testing.assert_array_equal(c.logits(), ref)


def test_seq_state_roundtrip(llama, model):
    toks = prompt_tokens(model, 20)
    with llama.Context(model, n_ctx=256, n_seq_max=2, kv_unified=False, n_threads=1) as c:
        c.decode(toks, seq_id=0)
        data = c.save_seq_state(0)
        c.load_seq_state(data, 1)
        assert c.n_tokens(1) == 20
        c.decode([300], seq_id=0)
        a = c.logits()
        c.decode([300], seq_id=1)
        np.testing.assert_array_equal(a, c.logits())


def test_bad_state_is_an_exception(llama, model, ctx, tmp_path):
    ctx.decode(prompt_tokens(model, 10))
    state = ctx.save_state()
    for bad in (b"\x00" * 16, state[: len(state) // 3], b"junk" * 100):
        with pytest.raises(llama.StateError):
            ctx.load_state(bad)
    with pytest.raises(llama.StateError):
        ctx.load_state(b"")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a state file" * 10)
    with pytest.raises(llama.StateError):
        ctx.load_state_file(junk)
    alive(llama, model)


# --------------------------------------------------------------------------
# threads


def test_context_threads_default_to_the_cpus_this_process_may_run_on(llama, model, gguf_models):
    """Not llama.cpp's 4: the CPUs this process may run on (params.default_n_threads), e.g. one
    when pinned to one CPU; given ones are kept."""
    import os
    import subprocess
    import sys

    from conftest import ROOT
    from pyllama_headinfer.params import default_n_threads

    n = default_n_threads()
    with llama.Context(model, n_ctx=64) as c:
        assert (c.n_threads, c.n_threads_batch) == (n, n)
    with llama.Context(model, n_ctx=64, n_threads=1, n_threads_batch=3) as c:
        assert (c.n_threads, c.n_threads_batch) == (1, 3)
    if not hasattr(os, "sched_setaffinity"):
        return
    code = ("import os, sys; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from pyllama_headinfer.llama import Model, Context; "
            "m = Model(sys.argv[1]); c = Context(m, n_ctx=64); print(c.n_threads, c.n_threads_batch)")
    result = subprocess.run([sys.executable, "-c", code, str(gguf_models["llama-gqa"])], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "1 1"


# --------------------------------------------------------------------------
# lifetimes


def test_use_after_close(llama, gguf_models):
    m = llama.Model(gguf_models["qwen2"])
    c = llama.Context(m, n_ctx=64, n_threads=1)
    s = llama.Sampler.greedy()
    c.decode(m.tokenize("hello"))
    gen = c.generate(m.tokenize("hello"), 5)
    next(gen)
    m.close()  # closes the context first
    assert c.closed and m.closed
    for call in (lambda: m.tokenize("x"), lambda: m.n_layer, lambda: c.decode([1]), lambda: c.logits(),
                 lambda: c.save_state(), lambda: c.seq_rm(0), lambda: next(gen), lambda: s.sample(c),
                 lambda: llama.Context(m), lambda: c.kv_residency()):
        with pytest.raises(llama.ClosedError):
            call()
    c.close()
    m.close()  # idempotent
    s.close()


def test_context_managers(llama, gguf_models):
    with llama.Model(gguf_models["qwen2"]) as m:
        with llama.Context(m, n_ctx=64, n_threads=1) as c:
            c.decode(m.tokenize("hello"))
        assert c.closed and not m.closed
    assert m.closed


def test_gc_frees_without_close(llama, gguf_models):
    """Objects dropped without close() are collected (ffi.gc then frees their
    llama.cpp handles) and the next model loads and decodes as before."""
    import gc
    import weakref

    for _ in range(3):
        m = llama.Model(gguf_models["qwen2"])
        c = llama.Context(m, n_ctx=64, n_threads=1)
        c.decode(m.tokenize("hello"))
        expected = c.logits()
        refs = [weakref.ref(m), weakref.ref(c)]
        del m, c
        gc.collect()
        assert [r() for r in refs] == [None, None]
    with llama.Model(gguf_models["qwen2"]) as m, llama.Context(m, n_ctx=64, n_threads=1) as c:
        c.decode(m.tokenize("hello"))
        assert np.array_equal(c.logits(), expected)


# --------------------------------------------------------------------------
# KV residency report (needs the HeadInfer C++)


def test_kv_residency_unsplit(llama, model, ctx):
    report = ctx.kv_residency()
    assert set(report) == {"buffers", "layers"}
    assert report["buffers"], "no KV buffers reported"
    assert not any(b["headinfer_host"] for b in report["buffers"].values())
    total_k = sum(b["k"] for b in report["buffers"].values())
    total_v = sum(b["v"] for b in report["buffers"].values())
    # f16 K and V: n_ctx * head_dim * n_head_kv * 2 bytes per layer
    expected = ctx.n_ctx * 64 * 4 * 2 * model.n_layer
    assert total_k == expected and total_v == expected
    assert [x["il"] for x in report["layers"]] == list(range(model.n_layer))
    for x in report["layers"]:
        assert x["n_head_kv"] == 4 and x["n_head_resident"] == 4 and not x["is_swa"]
    assert "KV residency" in llama.format_kv_residency(report)
    assert not math.isnan(ctx.headinfer_gpu_heads_frac)


def test_context_takes_one_params_record(llama, model):
    params = llama.ContextParams(n_ctx=64, n_threads=1)
    with llama.Context(model, params) as a, llama.Context(model, params, n_ctx=128) as b:
        assert a.params is params and a.n_ctx >= 64 and a.headinfer_gpu_heads_frac == 1.0
        assert b.params.n_ctx == 128 and b.params.n_threads == 1  # keywords replace fields of params
    with pytest.raises(TypeError, match="ContextParams"):
        llama.Context(model, 64)  # n_ctx is a keyword
    with pytest.raises(ValueError, match="not both"):
        llama.Context(model, params, headinfer_gpu_heads_frac=1.0, headinfer_vram_budget="1GiB")
    alive(llama, model)
