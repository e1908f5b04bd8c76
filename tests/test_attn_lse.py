"""``ggml_flash_attn_ext_lse`` on the CPU (patch 0031), against a float64 reference.

The op returns each row's log-sum-exp after its values and merges a previous
result over other KV cells; chunked attention (issue 30) is built on it. The
CPU is test-backend-ops' reference backend, so there it has nothing to be
compared with: this test calls libggml directly (cffi's ABI mode on the
build's libraries, a handful of declarations) and checks

* the values of a part alone are bit-identical to ``ggml_flash_attn_ext``'s
  (the same kernels; the LSE is one more store),
* the LSE is log(sum(exp(scores))) (float64 reference, f16 K/V),
* a part merged into another (``prev``) equals one attention over both,
* rows masked in one part take the other part's values; rows masked in both
  are 0 with LSE = -inf,

on each of the CPU's three kernels: one row at a time (a few query rows), the
KV-split decode path (one query row, >= 512 cells) and the tiled path (many
query rows).
"""

from __future__ import annotations

import numpy as np
import pytest

cffi = pytest.importorskip("cffi")

from pyllama_headinfer.runtime.manifest import find_manifest  # noqa: E402

CDEF = """
struct ggml_context;
struct ggml_tensor;
struct ggml_cgraph;
struct ggml_init_params { size_t mem_size; void * mem_buffer; bool no_alloc; };
struct ggml_context * ggml_init(struct ggml_init_params params);
void ggml_free(struct ggml_context * ctx);
struct ggml_tensor * ggml_new_tensor_4d(struct ggml_context * ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
struct ggml_tensor * ggml_view_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3,
                                  size_t nb1, size_t nb2, size_t nb3, size_t offset);
void * ggml_get_data(const struct ggml_tensor * tensor);
size_t ggml_nbytes(const struct ggml_tensor * tensor);
struct ggml_tensor * ggml_flash_attn_ext(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
                                         struct ggml_tensor * v, struct ggml_tensor * mask, float scale, float max_bias, float logit_softcap);
struct ggml_tensor * ggml_flash_attn_ext_lse(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
                                             struct ggml_tensor * v, struct ggml_tensor * mask, struct ggml_tensor * prev,
                                             float scale, float max_bias, float logit_softcap);
void ggml_flash_attn_ext_add_sinks(struct ggml_tensor * a, struct ggml_tensor * sinks);
struct ggml_cgraph * ggml_new_graph(struct ggml_context * ctx);
void ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
int ggml_graph_compute_with_ctx(struct ggml_context * ctx, struct ggml_cgraph * cgraph, int n_threads);
"""
GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1


@pytest.fixture(scope="module")
def ggml():
    manifest = find_manifest()
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    base = ffi.dlopen(str(manifest.lib_dir / "libggml-base.so"))
    cpu_libs = sorted(manifest.lib_dir.glob("libggml-cpu*.so"))
    if not cpu_libs or not hasattr(base, "ggml_flash_attn_ext_lse"):
        pytest.skip("this build has no ggml_flash_attn_ext_lse or no linked CPU backend library")
    cpu = ffi.dlopen(str(cpu_libs[0]))
    return ffi, base, cpu


class Graph:
    """One ggml context (allocating) for a few tensors and one graph."""

    def __init__(self, ggml, mem=256 << 20):
        self.ffi, self.base, self.cpu = ggml
        self.ctx = self.base.ggml_init({"mem_size": mem, "mem_buffer": self.ffi.NULL, "no_alloc": False})
        assert self.ctx != self.ffi.NULL

    def close(self):
        self.base.ggml_free(self.ctx)

    def tensor(self, array: np.ndarray):
        """A tensor holding ``array`` (numpy's shape is ggml's ne reversed)."""
        gtype = {np.float32: GGML_TYPE_F32, np.float16: GGML_TYPE_F16}[array.dtype.type]
        ne = list(reversed(array.shape)) + [1] * (4 - array.ndim)
        t = self.base.ggml_new_tensor_4d(self.ctx, gtype, *ne)
        self.ffi.memmove(self.base.ggml_get_data(t), np.ascontiguousarray(array).tobytes(), array.nbytes)
        return t

    def compute(self, *outs, n_threads=2):
        gf = self.base.ggml_new_graph(self.ctx)
        for out in outs:
            self.base.ggml_build_forward_expand(gf, out)
        assert self.cpu.ggml_graph_compute_with_ctx(self.ctx, gf, n_threads) == 0

    def read(self, t, shape):
        n = self.base.ggml_nbytes(t)
        return np.frombuffer(self.ffi.buffer(self.base.ggml_get_data(t), n), dtype=np.float32).reshape(shape).copy()


def reference(q, k, v, mask, scale, sinks=None):
    """float64 attention: values (n_batch, n_head, DV) and LSE (n_batch, n_head); masked rows: 0, -inf."""
    n_head, n_head_kv = q.shape[0], k.shape[0]
    kk = np.repeat(k.astype(np.float64), n_head // n_head_kv, axis=0)
    vv = np.repeat(v.astype(np.float64), n_head // n_head_kv, axis=0)
    s = np.einsum("hid,hjd->hij", q.astype(np.float64), kk) * scale + mask.astype(np.float64)[None]
    m = s.max(axis=2, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks[:, None, None])
    with np.errstate(invalid="ignore", divide="ignore"):
        e = np.exp(s - m)
        z = e.sum(axis=2, keepdims=True) + (0 if sinks is None else np.exp(sinks[:, None, None] - m))
        o = np.einsum("hij,hjd->hid", e / z, vv)
        lse = (m + np.log(z))[..., 0]
    o[~np.isfinite(lse)] = 0
    lse[~np.isfinite(lse)] = -np.inf
    return o.transpose(1, 0, 2), lse.T


# (query rows, cells of part a, cells of part b): which CPU kernel runs
KERNELS = {
    "row at a time": (3, 96, 160),
    "decode, KV split over threads": (1, 512, 768),
    "tiled": (67, 128, 192),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_lse_and_merge_match_one_attention_over_both_parts(ggml, kernel):
    n_batch, n_a, n_b = KERNELS[kernel]
    D, n_head, n_head_kv = 64, 8, 2
    rng = np.random.default_rng(30)
    q = rng.standard_normal((n_head, n_batch, D)).astype(np.float32)
    k = rng.standard_normal((n_head_kv, n_a + n_b, D)).astype(np.float16)
    v = rng.standard_normal((n_head_kv, n_a + n_b, D)).astype(np.float16)
    mask = np.where(rng.random((n_batch, n_a + n_b)) < 0.2, -np.inf, 0).astype(np.float16)
    if n_batch >= 3:  # row 1: masked in part a; row 2: in part b too
        mask[1, :n_a] = -np.inf
        mask[2, :] = -np.inf
    scale = 1 / np.sqrt(D)
    parts = {"a": slice(0, n_a), "b": slice(n_a, n_a + n_b)}

    g = Graph(ggml)
    try:
        qt = g.tensor(q)
        kv_t = {p: (g.tensor(np.ascontiguousarray(k[:, s])), g.tensor(np.ascontiguousarray(v[:, s])),
                    g.tensor(np.ascontiguousarray(mask[:, s]))) for p, s in parts.items()}
        lse_a = g.base.ggml_flash_attn_ext_lse(g.ctx, qt, *kv_t["a"], g.ffi.NULL, scale, 0.0, 0.0)
        plain_a = g.base.ggml_flash_attn_ext(g.ctx, qt, *kv_t["a"], scale, 0.0, 0.0)
        merged = g.base.ggml_flash_attn_ext_lse(g.ctx, qt, *kv_t["b"], lse_a, scale, 0.0, 0.0)
        whole = g.base.ggml_flash_attn_ext(g.ctx, qt, g.tensor(k), g.tensor(v), g.tensor(mask), scale, 0.0, 0.0)
        g.compute(lse_a, plain_a, merged, whole)
        got_a = g.read(lse_a, (n_batch, n_head, D + 1))
        got_plain_a = g.read(plain_a, (n_batch, n_head, D))
        got = g.read(merged, (n_batch, n_head, D + 1))
        got_whole = g.read(whole, (n_batch, n_head, D))
    finally:
        g.close()

    # part a alone: the values are ggml_flash_attn_ext's, bit for bit
    assert np.array_equal(got_a[..., :D], got_plain_a)
    want_o_a, want_lse_a = reference(q, k[:, parts["a"]], v[:, parts["a"]], mask[:, parts["a"]], scale)
    np.testing.assert_allclose(got_a[..., D], want_lse_a, atol=2e-3, rtol=1e-3)
    np.testing.assert_allclose(got_a[..., :D], want_o_a, atol=2e-3)

    # a merged into b = one attention over both (ggml's own, and the reference)
    want_o, want_lse = reference(q, k, v, mask, scale)
    np.testing.assert_allclose(got[..., D], want_lse, atol=2e-3, rtol=1e-3)
    np.testing.assert_allclose(got[..., :D], got_whole, atol=2e-3)  # f16 accumulators: other roundings
    np.testing.assert_allclose(got[..., :D], want_o, atol=2e-3)
    if n_batch >= 3:
        assert np.all(got_a[1, :, D] == -np.inf) and not got_a[1, :, :D].any()
        assert np.isfinite(got[1, :, D]).all()
        assert np.all(got[2, :, D] == -np.inf) and not got[2, :, :D].any()


@pytest.mark.parametrize("n_batch", [4, 70])  # 70 rows: the tiled kernel
def test_sinks_count_once_in_the_merged_lse(ggml, n_batch):
    """Sinks attached to one part only: the merge equals one attention with them."""
    n_a, n_b, D, n_head = 64, 96, 32, 4
    rng = np.random.default_rng(31)
    q = rng.standard_normal((n_head, n_batch, D)).astype(np.float32)
    k = rng.standard_normal((n_head, n_a + n_b, D)).astype(np.float16)
    v = rng.standard_normal((n_head, n_a + n_b, D)).astype(np.float16)
    mask = np.zeros((n_batch, n_a + n_b), dtype=np.float16)
    sinks = rng.uniform(-3, 3, n_head).astype(np.float32)
    scale = 1 / np.sqrt(D)
    g = Graph(ggml)
    try:
        qt = g.tensor(q)
        a = g.base.ggml_flash_attn_ext_lse(g.ctx, qt, g.tensor(np.ascontiguousarray(k[:, :n_a])),
                                           g.tensor(np.ascontiguousarray(v[:, :n_a])),
                                           g.tensor(np.ascontiguousarray(mask[:, :n_a])), g.ffi.NULL, scale, 0.0, 0.0)
        b = g.base.ggml_flash_attn_ext_lse(g.ctx, qt, g.tensor(np.ascontiguousarray(k[:, n_a:])),
                                           g.tensor(np.ascontiguousarray(v[:, n_a:])),
                                           g.tensor(np.ascontiguousarray(mask[:, n_a:])), a, scale, 0.0, 0.0)
        g.base.ggml_flash_attn_ext_add_sinks(b, g.tensor(sinks))
        g.compute(b)
        got = g.read(b, (n_batch, n_head, D + 1))
    finally:
        g.close()
    want_o, want_lse = reference(q, k, v, mask, scale, sinks=sinks.astype(np.float64))
    np.testing.assert_allclose(got[..., D], want_lse, atol=2e-3, rtol=1e-3)
    np.testing.assert_allclose(got[..., :D], want_o, atol=2e-3)
