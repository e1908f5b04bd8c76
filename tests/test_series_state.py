"""State I/O of split layers goes through llama.cpp's own I/O machinery
(issue 13.1): split layers are written and read with the row-interleaving
methods of ``llama_io_write_i``/``llama_io_read_i``, so

* a sequence state kept on the device (``LLAMA_STATE_SEQ_FLAGS_ON_DEVICE``)
  keeps the split layers' data on the device too, and round-trips;
* the host reader defers split layers like any tensor, so a restore that
  fails half-way (an iSWA state whose sliding-window part is cut short:
  the base cache reads fine, the SWA cache fails) leaves the cache exactly
  as the same failed restore leaves an unsplit cache.

The speed of the size query (the dummy writer only adds sizes) is a
benchmark, not a test: ``scripts/bench_state_size.py``.

The failed-restore test calls ``llama_state_set_data`` itself, so that what
it sees is llama.cpp's behaviour, whatever the Python API does after a
failure.  CPU: ``LLAMA_HEADINFER_FORCE_SPLIT=1`` puts the split on host layers.
"""

from __future__ import annotations

import numpy as np
import pytest

from testing_models import CORPUS, FORCE_SPLIT

N_PROMPT = 40
N_GEN = 8

pytestmark = pytest.mark.usefixtures("residency_llama")


@pytest.fixture(scope="module", autouse=True)
def force_split():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FORCE_SPLIT, "1")
        yield


def make_ctx(llama, model, frac, **kw):
    params = dict(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, flash_attn=True)
    params.update(kw)
    ctx = llama.Context(model, headinfer_gpu_heads_frac=frac, **params)
    split = [x for x in ctx.kv_residency()["layers"] if x["n_head_resident"] < x["n_head_kv"]]
    assert bool(split) == (frac < 1.0), ctx.kv_residency()
    return ctx


def same_bits(x, y) -> bool:
    return x.shape == y.shape and np.array_equal(x.view(np.uint32), y.view(np.uint32))


def greedy(llama, ctx, n) -> list:
    """n greedy steps from the current logits: the logits of each step."""
    out = []
    with llama.Sampler.greedy() as s:
        for i in range(n):
            out.append(ctx.logits(-1))
            tok = s.sample(ctx, -1)
            if i + 1 < n:
                ctx.decode([tok])
    return out


def seq_state_on_device(llama, model, frac):
    """Save sequence 0 with ON_DEVICE, continue (the reference), remove the
    sequence, restore it and continue again."""
    prompt = model.tokenize(CORPUS)[:N_PROMPT]
    with make_ctx(llama, model, frac) as ctx:
        lib, ffi, ptr = ctx._lib, ctx._ffi, ctx._ptr()
        on_device = lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE
        ctx.decode(prompt[:-1], logits="none")
        size_host = int(lib.llama_state_seq_get_size_ext(ptr, 0, 0))
        size_dev = int(lib.llama_state_seq_get_size_ext(ptr, 0, on_device))
        buf = ffi.new("uint8_t[]", size_dev)
        assert int(lib.llama_state_seq_get_data_ext(ptr, buf, size_dev, 0, on_device)) == size_dev
        ctx.decode(prompt[-1:])
        ref = greedy(llama, ctx, N_GEN)
        ctx.seq_rm(0)
        assert ctx.n_tokens() == 0
        assert int(lib.llama_state_seq_set_data_ext(ptr, buf, size_dev, 0, on_device)) == size_dev
        assert ctx.n_tokens() == len(prompt) - 1
        ctx.decode(prompt[-1:])
        again = greedy(llama, ctx, N_GEN)
    return size_host, size_dev, ref, again


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_seq_state_on_device_round_trips(llama, models, name):
    host_1, dev_1, ref_1, _ = seq_state_on_device(llama, models[name], 1.0)
    host_s, dev_s, ref_s, again_s = seq_state_on_device(llama, models[name], 0.5)
    # the tensor data of every layer, split or not, stays on the device: the bytes hold the metadata only,
    # as many as without the split
    assert dev_s == dev_1 and dev_s < host_s // 10, (dev_s, dev_1, host_s)
    assert host_s == host_1
    for step, (x, y) in enumerate(zip(ref_s, again_s)):
        assert same_bits(x, y), f"{name}: restored ON_DEVICE state differs at step {step}"
    for step, (x, y) in enumerate(zip(ref_1, ref_s)):
        assert same_bits(x, y), f"{name}: split differs from frac 1.0 at step {step}"


def failed_iswa_restore(llama, model, frac, cut):
    """Decode prompt A, save; replace it by prompt B; restore A's state cut
    short by ``cut`` bytes (the SWA cache's data is last: the base cache
    reads fine, the SWA cache fails); then decode one token: its logits."""
    toks = model.tokenize(CORPUS)
    a, b = toks[:N_PROMPT], toks[N_PROMPT:2 * N_PROMPT]
    with make_ctx(llama, model, frac) as ctx:
        ctx.decode(a, logits="none")
        state = ctx.save_state()
        ctx.seq_rm(-1)
        ctx.decode(b, logits="none")
        lib, ffi, ptr = ctx._lib, ctx._ffi, ctx._ptr()
        broken = state[:-cut]
        assert int(lib.llama_state_set_data(ptr, ffi.from_buffer("uint8_t[]", broken), len(broken))) == 0
        ctx.decode(toks[2 * N_PROMPT:2 * N_PROMPT + 1])
        return ctx.logits(-1), ctx.seq_pos_max(0)


@pytest.mark.parametrize("cut", [1, 4096])
def test_failed_iswa_restore_leaves_split_cache_as_unsplit(llama, models, cut):
    base, pos_base = failed_iswa_restore(llama, models["gemma3-iswa"], 1.0, cut)
    split, pos_split = failed_iswa_restore(llama, models["gemma3-iswa"], 0.5, cut)
    assert pos_base == pos_split
    assert same_bits(base, split), f"after a failed restore the split cache differs (max |diff| " \
                                   f"{np.abs(base - split).max():g})"
