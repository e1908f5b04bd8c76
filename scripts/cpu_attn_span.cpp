// How fast the CPU's flash attention reads a decoded token's KV, against how much KV it reads: fit (common/fit.cpp)
// times layers of the context's cells, up to 1 GiB (it timed one layer's 64 MiB before, which a large last-level
// cache holds); this compares the two on a machine. Times FLASH_ATTN_EXT at one query row over N_LAYER buffers of MIB MiB of KV cells each (rounded to
// 256 cells, as fit rounds), laid out as the KV cache holds them (a row of every KV head per cell), the 8B shape's
// heads (32 query heads over 8 KV heads of 128).
//
//   g++ -O2 -std=c++17 -I LLAMA_SRC/ggml/include scripts/cpu_attn_span.cpp -L BIN -lggml -lggml-base -lggml-cpu
//       -Wl,-rpath,BIN -o cpu_attn_span          (one line; BIN: a build's bin folder, `scripts/gpu_session.sh OUT cpu-attn`)
//   ./cpu_attn_span MIB N_LAYER N_THREADS [f16|q8_0]       (prints the KV bytes per second, best of 3, and each run)
#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MIB N_LAYER N_THREADS [f16|q8_0]\n", argv[0]);
        return 2;
    }
    const int64_t   mib       = atoll(argv[1]);
    const int       n_layer   = atoi(argv[2]);
    const int       n_threads = atoi(argv[3]);
    const ggml_type type      = argc > 4 && strcmp(argv[4], "q8_0") == 0 ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
    const int64_t   head = 128, n_head = 32, n_head_kv = 8;
    if (mib <= 0 || n_layer <= 0 || n_threads <= 0) {
        fprintf(stderr, "MIB, N_LAYER and N_THREADS must be positive\n");
        return 2;
    }
    const size_t  cell = 2*n_head_kv*ggml_row_size(type, head); // K and V
    const int64_t n_kv = GGML_PAD(std::max<int64_t>(1, mib*1024*1024 / (int64_t) cell), 256);

    ggml_init_params ip = { size_t(n_layer)*8*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    size_t bytes = 0;
    for (int il = 0; il < n_layer; il++) {
        ggml_tensor * q  = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, head, 1, n_head);
        ggml_tensor * kc = ggml_new_tensor_2d(ctx, type, head*n_head_kv, n_kv);
        ggml_tensor * vc = ggml_new_tensor_2d(ctx, type, head*n_head_kv, n_kv);
        ggml_tensor * k  = ggml_view_3d(ctx, kc, head, n_kv, n_head_kv, kc->nb[1], ggml_row_size(type, head), 0);
        ggml_tensor * v  = ggml_view_3d(ctx, vc, head, n_kv, n_head_kv, vc->nb[1], ggml_row_size(type, head), 0);
        ggml_build_forward_expand(gf, ggml_flash_attn_ext(ctx, q, k, v, nullptr, 1.0f, 0.0f, 0.0f));
        bytes += ggml_nbytes(kc) + ggml_nbytes(vc);
    }
    ggml_backend_t cpu = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(cpu, n_threads);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, cpu);
    if (buf == nullptr) {
        fprintf(stderr, "could not allocate %zu MiB\n", bytes >> 20);
        return 1;
    }
    ggml_backend_buffer_clear(buf, 0);

    double runs[3];
    double best = 0.0;
    for (double & rate : runs) {
        const int64_t t0 = ggml_time_us();
        if (ggml_backend_graph_compute(cpu, gf) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "compute failed\n");
            return 1;
        }
        rate = bytes / (std::max<int64_t>(1, ggml_time_us() - t0) * 1e-6) / 1e9;
        best = std::max(best, rate);
    }
    printf("%s, %lld cells x %d layers = %zu MiB, %d threads: %.1f GB/s (runs %.1f %.1f %.1f)\n", ggml_type_name(type),
        (long long) n_kv, n_layer, bytes >> 20, n_threads, best, runs[0], runs[1], runs[2]);

    ggml_backend_buffer_free(buf);
    ggml_backend_free(cpu);
    ggml_free(ctx);
    return 0;
}
