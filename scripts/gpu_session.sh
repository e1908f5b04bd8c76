#!/usr/bin/env bash
# The GPU checks and measurements of the series, on a machine without network (the device tool's GPU), in parts that
# each fit one call of at most 10 minutes:
#
#   scripts/gpu_session.sh OUTDIR first   # this series' build (-j 16), `checks` but for the long op suites, `serve`
#   scripts/gpu_session.sh OUTDIR quick   # the least: this series without tools, FLASH_ATTN_EXT_LSE, gpu_check both modes
#   scripts/gpu_session.sh OUTDIR build   # CUDA builds, one after the other at -j 16, of the variants in
#                                         # $HI_BUILD_VARIANTS (default "new pin old"): this series (tools, tests,
#                                         # bindings), the pin itself (test-backend-ops) and the series before it
#                                         # (tools), sm_90, 3-5 min each (this series with tools and tests:
#                                         # 3m11s on an H100 host, more than 270 s on an H200 host); a later
#                                         # call resumes what a limit stopped
#   scripts/gpu_session.sh OUTDIR checks  # test-backend-ops for the ops the series touches, test-backend-sched,
#                                         # test-llama-archs, gpu_check --no-cuda-fusion joined and chunked (~5 min)
#   scripts/gpu_session.sh OUTDIR perf    # plain FLASH_ATTN_EXT perf, the pin against this series, two passes each
#                                         # (~2 min a pass on an H100, 8 min in all; scripts/gpu_tables.py perf
#                                         # reads it; HI_PERF_VARIANTS=new runs this series' pass alone)
#   scripts/gpu_session.sh OUTDIR decode  # the decode table, this series against the series before it, one model,
#                                         # interleaved, with the host-to-device copy rate before and after (~5 min;
#                                         # scripts/gpu_tables.py decode reads it)
#   scripts/gpu_session.sh OUTDIR fit     # llama.cpp's --fit with the split against its answer without, for the
#                                         # rows in $HI_FIT_ROWS (CTX:CARD_GIB,...; scripts/fit_table.py), KV type
#                                         # $HI_FIT_TYPE (f16), the context filled as $HI_FIT_FILL says (bench)
#   scripts/gpu_session.sh OUTDIR tools   # this series' tools alone (-j 16), for the fit part of the same call
#   scripts/gpu_session.sh OUTDIR cpu-attn  # the CPU's flash attention at decode over 64 MiB of KV (what fit timed
#                                         # before) against the spans it times now, up to 2 GiB (scripts/cpu_attn_span.cpp)
#   scripts/gpu_session.sh OUTDIR serve   # llama-server, 4 slots of 32K cells, one KV stream each, in chunks, and a
#                                         # context shift: the device buffers against plan's (frac 1 and 0.5)
#
# Needs, in the checkout: .gpu-carry/llama.cpp-<pin commit>.tar.gz (a GitHub-style archive of the pin's tree),
# .gpu-carry/old-series/ (the series to compare with: its patches and `series` file) and .whl/ (cffi, pycparser and
# gguf wheels for the machine's python3); both folders ignored by git and named in the device tool's `carry`.
# Builds go to build/cuda-new, build/cuda-old and build/cuda-pin.
set -uo pipefail

out=${1:?usage: $0 OUTDIR first|build|quick|checks|perf|decode|fit|tools|cpu-attn|serve}
part=${2:?usage: $0 OUTDIR first|build|quick|checks|perf|decode|fit|tools|cpu-attn|serve}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
mkdir -p "$out"
commit=$(PYTHONPATH=$root python3 -c 'from pyllama_headinfer import pin; print(pin.active().commit)')
archive=.gpu-carry/llama.cpp-$commit.tar.gz
if [ -d .whl ] && [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$root
model=/tmp/b8.gguf

tree() {  # variant: its copy of the pin's tree (extracted once per machine: a call that resumes a build keeps it)
    local d=/tmp/src-$1
    [ -d "$d/llama.cpp-$commit" ] || { mkdir -p "$d" && tar xzf "$archive" -C "$d"; }
    echo "$d/llama.cpp-$commit"
}

build_variant() {  # variant, series directory, then build options: the project's build of the pin with that series
    local v=$1 series=$2
    shift 2
    mkdir -p "/tmp/cache-$v/downloads"
    { time timeout "${HI_BUILD_TIMEOUT:-560}" env PYLLAMA_HEADINFER_CACHE=/tmp/cache-$v PYLLAMA_HEADINFER_PATCHES=$series \
        python3 -m pyllama_headinfer build --llama-src "$(tree "$v")" --build-dir "build/cuda-$v" --cuda-arch 90 "$@"; } \
        > "$out/build-$v.log" 2>&1
    echo "build exit $?" >> "$out/build-$v.log"
}

build_pin() {  # jobs: the pin itself, plain CMake with the flags that matter to the kernels (those of the project's
              # build), ggml and test-backend-ops only
    { time timeout "${HI_BUILD_TIMEOUT:-560}" bash -c "cmake -S '$(tree pin)' -B build/cuda-pin -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > /dev/null && ninja -C build/cuda-pin -j $1 test-backend-ops"; } \
        > "$out/build-pin.log" 2>&1
    echo "build exit $?" >> "$out/build-pin.log"
}

bench_model() {  # the 8B-shaped benchmark model (random weights; scripts/make_bench_model.py), once per machine
    [ -f "$model" ] || python3 scripts/make_bench_model.py --out "$model"
}

case $part in
first)  # this series alone (-j 16), its checks, then the llama-server memory run (`serve`): the most a GPU call
        # gives when only one or two can be had
    build_variant new "$root/patches/b11312" --tools -j 16 -DLLAMA_BUILD_TESTS=ON
    { time timeout 300 ninja -C build/cuda-new test-backend-ops test-backend-sched test-llama-archs; } >> "$out/build-new.log" 2>&1
    echo "tests build exit $?" >> "$out/build-new.log"
    HI_CHECK_OPS="FLASH_ATTN_EXT_LSE" bash "$0" "$out" checks
    bash "$0" "$out" serve
    ;;
build)  # one after the other, each with every core: three builds side by side on 16 cores finished none of them in
        # 740 s, where one alone takes ~200 s, and a finished build is what the next part needs
    for v in ${HI_BUILD_VARIANTS:-new pin old}; do
        case $v in
        new) build_variant new "$root/patches/b11312" --tools -j 16 -DLLAMA_BUILD_TESTS=ON
             { time timeout 300 ninja -C build/cuda-new test-backend-ops test-backend-sched test-llama-archs; } \
                 >> "$out/build-new.log" 2>&1
             echo "tests build exit $?" >> "$out/build-new.log" ;;
        pin) build_pin 16 ;;
        old) build_variant old "$root/.gpu-carry/old-series" --tools --no-bindings -j 16 ;;
        *) echo "unknown build variant: $v" >&2; exit 2 ;;
        esac
    done
    ;;
quick)  # the least that checks the log-sum-exp attention on CUDA: this series without its tools (-j 16), its
        # FLASH_ATTN_EXT_LSE op suite, then gpu_check chunked and joined (for a call too short for `first`)
    build_variant new "$root/patches/b11312" -j 16 -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TESTS=ON
    { time timeout 200 ninja -C build/cuda-new test-backend-ops; } >> "$out/build-new.log" 2>&1
    { echo "== test-backend-ops -o FLASH_ATTN_EXT_LSE -b CUDA0"
      timeout 120 build/cuda-new/bin/test-backend-ops -o FLASH_ATTN_EXT_LSE -b CUDA0 2>&1 | grep -E "FAIL|tests passed|Backend CUDA0"
      echo "exit ${PIPESTATUS[0]}"; } >> "$out/test_backend_ops.txt"
    export PYLLAMA_HEADINFER_BUILD_DIR=$root/build/cuda-new
    { time env GGML_CUDA_DISABLE_FUSION=1 python3 scripts/gpu_check.py --no-cuda-fusion --attn chunked --attn-chunk 256 \
        --scenarios greedy,state,shift,streams,full; } > "$out/gpu_check_chunked.txt" 2>&1
    echo "gpu_check exit $?" >> "$out/gpu_check_chunked.txt"
    { time env GGML_CUDA_DISABLE_FUSION=1 python3 scripts/gpu_check.py --no-cuda-fusion; } > "$out/gpu_check_joined.txt" 2>&1
    echo "gpu_check exit $?" >> "$out/gpu_check_joined.txt"
    ;;
checks)  # the checks never run on a GPU before first, then the rest
    tbo=build/cuda-new/bin/test-backend-ops
    tbo_op() {
        { echo "== test-backend-ops -o $1 -b CUDA0"
          timeout 200 "$tbo" -o "$1" -b CUDA0 2>&1 | grep -E "FAIL|tests passed|Backend CUDA0"
          echo "exit ${PIPESTATUS[0]}"; } >> "$out/test_backend_ops.txt"
    }
    tbo_op FLASH_ATTN_EXT_LSE
    export PYLLAMA_HEADINFER_BUILD_DIR=$root/build/cuda-new
    { time env GGML_CUDA_DISABLE_FUSION=1 python3 scripts/gpu_check.py --no-cuda-fusion --attn chunked --attn-chunk 256 \
        --scenarios greedy,state,shift,streams,full; } > "$out/gpu_check_chunked.txt" 2>&1
    echo "gpu_check exit $?" >> "$out/gpu_check_chunked.txt"
    { time env GGML_CUDA_DISABLE_FUSION=1 python3 scripts/gpu_check.py --no-cuda-fusion; } > "$out/gpu_check_joined.txt" 2>&1
    echo "gpu_check exit $?" >> "$out/gpu_check_joined.txt"
    { time build/cuda-new/bin/test-backend-sched; } > "$out/test_backend_sched.txt" 2>&1
    echo "test-backend-sched exit $?" >> "$out/test_backend_sched.txt"
    build/cuda-new/bin/test-llama-archs -a llama > "$out/test_llama_archs.txt" 2>&1
    echo "test-llama-archs exit $?" >> "$out/test_llama_archs.txt"
    for op in ${HI_CHECK_OPS-SET_ROWS CONCAT CPY FLASH_ATTN_EXT}; do [ "$op" = FLASH_ATTN_EXT_LSE ] || tbo_op "$op"; done
    ;;
perf)
    # plain flash attention, decode and prefill shapes of an 8B-shaped model's heads: the series must not change it
    for v in ${HI_PERF_VARIANTS:-pin new pin new}; do
        echo "== $v" >> "$out/fa_perf.txt"
        timeout 240 "build/cuda-$v/bin/test-backend-ops" perf -o FLASH_ATTN_EXT -b CUDA0 2>&1 | grep -E "FLASH_ATTN_EXT\(" \
            >> "$out/fa_perf.txt"
    done
    ;;
decode)
    bench_model > "$out/model.log" 2>&1
    { echo "== before"; python3 scripts/h2d_bandwidth.py; } > "$out/h2d.txt" 2>&1
    for args in "-hgf 1,0.75,0.5,0.25 -d 8192,32768 -n 32" "-hgf 1,0.5,0.25 -d 131072 -n 16 -ub 2048"; do
        for v in old new; do
            echo "== $v: llama-bench -m b8 -ngl 99 -fa 1 -ctk f16 -ctv f16 -p 0 -r 1 $args" >> "$out/decode.md"
            # shellcheck disable=SC2086
            "build/cuda-$v/bin/llama-bench" -m "$model" -ngl 99 -fa 1 -ctk f16 -ctv f16 -p 0 -r 1 $args -o md \
                >> "$out/decode.md" 2>> "$out/decode.err"
        done
    done
    { echo "== after"; python3 scripts/h2d_bandwidth.py; } >> "$out/h2d.txt" 2>&1
    ;;
tools)
    build_variant new "$root/patches/b11312" --tools -j 16
    ;;
fit)  # HI_FIT_FILL: bench or state (scripts/fit_table.py --fill), HI_FIT_TYPE: the KV type (f16)
    bench_model > "$out/model.log" 2>&1
    export PYLLAMA_HEADINFER_BUILD_DIR=$root/build/cuda-new
    table=$out/fit_table-${HI_FIT_FILL:-bench}-${HI_FIT_TYPE:-f16}.md
    { time python3 -u scripts/fit_table.py --bin build/cuda-new/bin --model "$model" --type "${HI_FIT_TYPE:-f16}" \
        --fill "${HI_FIT_FILL:-bench}" --rows "${HI_FIT_ROWS:-32768:8,131072:12,131072:16}" \
        --log-dir "$out/fit-logs"; } >> "$table" 2>&1
    echo "fit_table exit $?" >> "$table"
    ;;
cpu-attn)  # after `build` (this series' ggml): how much faster a span the last-level cache holds is read
    g++ -O2 -std=c++17 -I "$(tree new)/ggml/include" scripts/cpu_attn_span.cpp -L build/cuda-new/bin -lggml \
        -lggml-base -lggml-cpu -Wl,-rpath,"$root/build/cuda-new/bin" -o /tmp/cpu_attn_span || exit 1
    { lscpu | grep -E "Model name|L3|NUMA node\(s\)"
      for type in f16 q8_0; do
          for span in "64 1" "128 1" "128 8" "512 1" "512 4"; do  # MiB a layer, layers
              # shellcheck disable=SC2086
              /tmp/cpu_attn_span $span "$(nproc)" $type
          done
      done; } > "$out/cpu_attn_span.txt" 2>&1
    ;;
serve)
    bench_model > "$out/model.log" 2>&1
    export PYLLAMA_HEADINFER_BUILD_DIR=$root/build/cuda-new
    { time python3 -u scripts/server_bench.py memory --model "$model" --frac 1,0.5 --slots 4 --ctx 32768 \
        --prompt-tokens 32000 --max-tokens 16 --ngl 99 --client http --json "$out/server_memory.json" \
        -- --headinfer-attn chunked; } > "$out/server_memory.md" 2>&1
    echo "server_bench exit $?" >> "$out/server_memory.md"
    ;;
*)
    echo "unknown part: $part" >&2
    exit 2
    ;;
esac
