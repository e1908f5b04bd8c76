#!/usr/bin/env bash
# One GPU session's measurements, on a machine without network (the H200 of the device tool).
#
#   scripts/h200_session.sh OUTDIR build    # CUDA build of the series (+ tools, test-backend-ops)
#   scripts/h200_session.sh OUTDIR checks   # gpu_check --no-cuda-fusion, test-backend-ops, series checks
#   scripts/h200_session.sh OUTDIR bench    # llama-bench: fractions x KV types at 8K/32K/128K, k-token steps
#   scripts/h200_session.sh OUTDIR stream   # the data path: decode/fill with streaming on and off, splits, buffers
#   scripts/h200_session.sh OUTDIR serve    # llama-server: 1/2/4 slots under load, speculative decoding (~4 min)
#   scripts/h200_session.sh OUTDIR streams  # per-slot streams, attention per part: exactness, decode, buffers, slots (~7 min)
#   scripts/h200_session.sh OUTDIR slots    # per-slot streams far from full vs unified, 32K decode repeated (~3 min)
#   scripts/h200_session.sh OUTDIR state    # gpu_check --no-cuda-fusion, then llama-server slot save/restore at 32K (~3 min)
#   scripts/h200_session.sh OUTDIR params   # headinfer_stream / headinfer_attn as parameters: exactness, decode, splits (~3 min)
#   scripts/h200_session.sh OUTDIR pin      # a pin's checks: gpu_check, test-backend-ops, test-llama-archs, 32K decode (~3 min)
#   scripts/h200_session.sh OUTDIR writeback # host stores written back from the device: exactness, decode 8K-128K, buffers, host time (~5 min)
#   scripts/h200_session.sh OUTDIR sched    # tests/test-backend-sched on CUDA0, exactness, decode 8K/32K (-r 3), host time, 128K f 0.25 (~5 min)
#   scripts/h200_session.sh OUTDIR hygiene  # exactness (fusion off, streamed and not), test-backend-ops + CONCAT perf, test-backend-sched (~4 min)
#   scripts/h200_session.sh OUTDIR lse      # chunked attention on CUDA: test-backend-ops, exactness, decode 32K/128K, fill (~5 min)
#   HI_VARIANT_LIB=DIR scripts/h200_session.sh OUTDIR variant  # 32K f 0.75 against another libggml-base, in one run
#   scripts/h200_session.sh OUTDIR timeline  # copy engine busy/idle per step from a CUDA trace (decode_timeline.py)
#   [HI_VARIANT_LIB=DIR] scripts/h200_session.sh OUTDIR chunked128  # chunked 128K f 0.25: copy engine per step, decode
#   scripts/h200_session.sh OUTDIR row128   # issue 29's 128K row at every fraction (~1.5 min)
#   scripts/h200_session.sh OUTDIR first128 # chunked 128K f 0.25 with three slots and two, then the copy rate's spread (~3 min)
#   HI_VARIANT_LIB=DIR scripts/h200_session.sh OUTDIR ahead  # 32K f 0.75 against another libggml-base: copy engine at the step boundary, decode (~2.5 min)
#   scripts/h200_session.sh OUTDIR slots3   # three staging slots against two (GGML_SCHED_STREAM_SLOTS=2) in one run: test-backend-sched, exactness, 32K, timeline (~6 min)
#   scripts/h200_session.sh OUTDIR lse128   # test-backend-ops, then fill + decode at 128K (HI_BB_DEPTH) in llama-batched-bench, chunked and joined (~6 min)
#   scripts/h200_session.sh OUTDIR lsebuf   # chunked and joined compute buffers at n_ubatch 2048, 8K-256K (~3 min)
#   scripts/h200_session.sh OUTDIR issue30  # issue 30's open figures: exactness in chunks (a full cache too), 256K q8_0 f 0.125 between copy rates, chunked 32K (bench, trace) (~8 min)
#   scripts/h200_session.sh OUTDIR issue29  # issue 29's whole check: copy rate, test-backend-sched, exactness, table 8K-128K, buffers (~9 min)
#   scripts/h200_session.sh OUTDIR exact    # exactness with fusion off, chunked (a full cache too) and joined (~30 s)
#   [HI_VARIANT_LIB=DIR] scripts/h200_session.sh OUTDIR w44  # 0044 on the GPU: test-backend-sched, exactness, buffers 8K-256K, fill against DIR's libggml-base, 256K q8_0 frac 1.0 (~8 min)
#   scripts/h200_session.sh OUTDIR rowmeta  # 0045 (the MMA kernel's row sums): test-backend-ops + perf, exactness, fill 8K/32K chunked and joined, chunked vs joined at 32K (~8 min)
#   HI_VARIANT_LIB=DIR scripts/h200_session.sh OUTDIR groups  # 0046 (groups, not splits): test-backend-sched, exactness, 128K q8_0 f 0.125 chunked against DIR's libggml-base (~9 min)
#   HI_VARIANT_LIB=DIR scripts/h200_session.sh OUTDIR groups2 # 0046: joined 128K f 0.25 and chunked 32K f 0.25 against DIR's libggml-base (~8 min)
#   [HI_VARIANT_LIB=DIR] scripts/h200_session.sh OUTDIR groups256 # 256K chunked, q8_0 f 0.125 and f16 f 0.25: fill, decode, splits, buffer vs reserve (~7 min)
#   scripts/h200_session.sh OUTDIR chunks   # does a split per chunk cost decode speed: 128K q8_0 f 0.125 in chunks of 8K/16K/32K cells (~6 min)
#   scripts/h200_session.sh OUTDIR table    # issue 29's decode table (8K/32K -r 2, 128K) and compute buffers at n_ubatch 2048 (~5 min)
#
# PYLLAMA_HEADINFER_PIN picks the pin (its build directory is build/cuda-sm90-<pin> for a pin other than the
# default); HI_CARRY names the carried directory of source archives (default .gpu-carry; the device carries
# 64 MiB, so one pin's source per session: e.g. .gpu-carry-b11549/ holding the xllamacpp sdist).
#
# Needs, in the checkout: .gpu-carry/llama.cpp-<pin commit>.tar.gz (a GitHub-style archive of the pin,
# e.g. the sdist's vendor/llama.cpp packed under llama.cpp-<commit>/), and .whl/ with the wheels of
# cffi, pycparser and gguf for the machine's python3 (the device tool's README says how).
set -uo pipefail

out=${1:?usage: $0 OUTDIR build|checks|bench|stream|serve|streams|slots|state|pin|params|writeback|quick29|sched|hygiene|table|lse|lse128|lsebuf}
part=${2:?usage: $0 OUTDIR build|checks|bench|stream|serve|streams|slots|state|pin|params|writeback|quick29|sched|hygiene|table|lse|lse128|lsebuf}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
mkdir -p "$out"
export PYLLAMA_HEADINFER_CACHE=${PYLLAMA_HEADINFER_CACHE:-/tmp/hi-cache}
mkdir -p "$PYLLAMA_HEADINFER_CACHE/downloads"
cp -n "${HI_CARRY:-.gpu-carry}"/*.tar.gz "$PYLLAMA_HEADINFER_CACHE/downloads/" 2>/dev/null || true
if [ -d .whl ] && [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$root
pin=${PYLLAMA_HEADINFER_PIN:-b11312}
bdir=$root/build/cuda-sm90$([ "$pin" = b11312 ] || echo "-$pin")
bench=$bdir/bin/llama-bench
model=/tmp/b8.gguf

# HI_PREBUILT (optional): an archive of this series' CUDA build made on a machine without a GPU
# (scripts/prebuilt_cuda.py; docs/GPU.md "A build carried to the GPU"): part `build` unpacks it instead of compiling.
# Such a build names cuBLAS by the path it had where it was made: find this machine's.
use_cuda_libs() {
    local d
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
             $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
        if [ -e "$d/libcublas.so.13" ]; then
            export LD_LIBRARY_PATH=$bdir/bin:$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
            return 0
        fi
    done
    echo "no libcublas.so.13 on this machine" >&2
    return 1
}
if grep -q '"relocated_from"' "$bdir/manifest.json" 2>/dev/null; then
    use_cuda_libs
fi

# HI_DEADLINE (epoch seconds, optional): every step of a part stops by then (the device's per-call limit)
tl() {
    local left=$(( ${HI_DEADLINE:-$(( $(date +%s) + 100000 ))} - $(date +%s) ))
    if [ "$left" -le 5 ]; then echo "skipped (deadline): $*" >&2; return 124; fi
    timeout "$left" "$@"
}

variant_env() {  # LD_LIBRARY_PATH=<HI_VARIANT_LIB, absolute>: the variant's libraries before the build's own (RUNPATH),
                 # and before cuBLAS's directory where a carried build found it (use_cuda_libs)
    echo "LD_LIBRARY_PATH=$(cd "$HI_VARIANT_LIB" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

run_env() {  # the environment of one run of a comparison, by its name: variant* -> variant_env, two* -> two staging
             # slots (GGML_SCHED_STREAM_SLOTS=2, patch 0042), pass* -> the log-sum-exp by the pass over K everywhere
             # (GGML_CUDA_FATTN_LSE_PASS=1, patch 0045), anything else (this, three, ...) -> none
    case $1 in
        variant*) variant_env ;;
        two*) echo GGML_SCHED_STREAM_SLOTS=2 ;;
        pass*) echo GGML_CUDA_FATTN_LSE_PASS=1 ;;
    esac
}

pack_raw() {  # archive, then files or directories in OUTDIR: packed into OUTDIR/archive (those that exist), then removed
             # (the device returns a few files per call)
    local archive=$1 f
    shift
    local present=()
    for f in "$@"; do
        [ -e "$out/$f" ] && present+=("$f")
    done
    [ ${#present[@]} -gt 0 ] && tar czf "$out/$archive" -C "$out" "${present[@]}" && \
        for f in "${present[@]}"; do rm -rf "${out:?}/$f"; done
}

copy_rate() {  # a label, then the machine's host-to-device copy rate (h2d_bandwidth.py) under it in h2d.txt: measured
               # before and after a part's benchmarks, whose ceiling it gives
    { echo "== $1"; tl python3 scripts/h2d_bandwidth.py; } >> "$out/h2d.txt" 2>&1
}

bench_model() {  # the 8B-shaped benchmark model (random weights; scripts/make_bench_model.py), made once per machine
    [ -f "$model" ] || python3 scripts/make_bench_model.py --out "$model"
}
lb() {  # name, then llama-bench arguments: markdown to bench.md, JSON kept for the speed model check
    local name=$1
    shift
    echo "== $name: ${LB_ENV:-} llama-bench -m $(basename "$model") -ngl 99 -fa 1 $*" >> "$out/bench.md"
    tl env ${LB_ENV:-} "$bench" -m "$model" -ngl 99 -fa 1 "$@" -o json > "$out/json/$name.json" 2>> "$out/bench.err"
    python3 - "$out/json/$name.json" >> "$out/bench.md" <<'EOF'
import json, sys
text = open(sys.argv[1]).read()
for r in json.loads(text[text.index("["):]) if "[" in text else []:
    print(f"| {r['type_k']}/{r['type_v']} | hgf {r.get('headinfer_gpu_heads_frac', 1):g} | depth {r['n_depth']} "
          f"| p {r['n_prompt']} n {r['n_gen']} ub {r['n_ubatch']} | {r['avg_ts']:.2f} tok/s |")
EOF
}

bb() {  # depth, then flags: llama-batched-bench fills depth tokens at n_ubatch 2048 and decodes 16 (KV type HI_BB_KV,
        # default f16; environment BB_ENV, e.g. run_env's), into bb.md with the compute buffer and the graph splits
    local depth=$1
    shift
    local args=(-m "$model" -ngl 99 -fa on -ctk "${HI_BB_KV:-f16}" -ctv "${HI_BB_KV:-f16}" -c $(( depth + 256 )) -b 2048 -ub 2048 -npp "$depth" -ntg 16 -npl 1 -v "$@")
    echo "== ${BB_ENV:-} llama-batched-bench ${args[*]}" >> "$out/bb.md"
    { time tl env ${BB_ENV:-} "$bdir/bin/llama-batched-bench" "${args[@]}"; } 2>> "$out/bb.err" | grep "^|" >> "$out/bb.md"
    grep "I sched_reserve: *CUDA0 compute buffer size" "$out/bb.err" | tail -1 >> "$out/bb.md"
    grep "graph_reserve: graph.*splits = " "$out/bb.err" | tail -1 >> "$out/bb.md"
}

exactness_fusion_off() {  # gpu_check with CUDA fusion off (and any further gpu_check arguments), its time and exit
                          # status, into gpu_check.txt
    { time tl env GGML_CUDA_DISABLE_FUSION=1 python3 scripts/gpu_check.py --no-cuda-fusion "$@"; } > "$out/gpu_check.txt" 2>&1
    echo "gpu_check exit $?" >> "$out/gpu_check.txt"
}

exactness_in_chunks() {  # gpu_check with fusion off in chunked mode, every scenario: chunks of 256 cells, so that the
                         # `full` scenario's last chunk ends the cache (its spare row before it)
    exactness_fusion_off --attn chunked --attn-chunk 256 --scenarios greedy,state,shift,streams,full
}

exactness_chunked_and_joined() {  # exactness_in_chunks into gpu_check_chunked.txt, then joined into gpu_check.txt
    exactness_in_chunks
    mv "$out/gpu_check.txt" "$out/gpu_check_chunked.txt"
    exactness_fusion_off
}

buffer_table() {  # contexts (comma-separated), then a log file in OUTDIR: graph_splits.py's compute buffers and splits at
                  # n_ubatch 2048, fractions 1 / 0.5 / 0.25, chunked and joined, into splits.txt
    local ctxs=$1 log=$2 attn
    for attn in chunked joined; do
        { echo "== python3 scripts/graph_splits.py --attn $attn --ubatch 2048 --ctx $ctxs --fracs 1,0.5,0.25"
          tl python3 scripts/graph_splits.py --model "$model" --attn $attn --ubatch 2048 --ctx "$ctxs" \
              --fracs 1,0.5,0.25; } >> "$out/splits.txt" 2>> "$out/$log"
    done
}

exactness_streamed_and_not() {  # gpu_check with fusion off, streamed (the default) and not, into gpu_check.txt
    exactness_fusion_off
    { echo "== --stream off"; tl env GGML_CUDA_DISABLE_FUSION=1 python3 scripts/gpu_check.py --no-cuda-fusion --stream off \
          --types f16 --fracs 0.5 2>&1 | tail -3; } >> "$out/gpu_check.txt"
}

flash_attn_test_backend_ops() {  # the flash attention ops (the log-sum-exp ones included) against the CPU, then the
    # time of one chunk of 8192 cells of the 8B shape, plain and with its log-sum-exp (patch 0039), at 1 and 4096 rows
    local chunk='hsk=128,hsv=128,nh=8,nr23=\[4,1\],kv=8192,(kv_prev=256,)?nb=(1|4096),'
    { echo "== test-backend-ops -o FLASH_ATTN_EXT -b CUDA0 -p kv_prev"
      tl "$bdir/bin/test-backend-ops" -o FLASH_ATTN_EXT -b CUDA0 -p kv_prev 2>&1 | grep -v "^ggml_cuda_init\|Device 0"
      echo "== test-backend-ops perf -o FLASH_ATTN_EXT -b CUDA0 -p '$chunk'"
      tl "$bdir/bin/test-backend-ops" perf -o FLASH_ATTN_EXT -b CUDA0 -p "$chunk" 2>&1 | grep "FLASH_ATTN_EXT("; } \
        > "$out/test_backend_ops.txt" 2>&1
}

scheduler_test() {  # the series' scheduler test (ggml only) on CUDA0, compiled against the build's libraries as
                    # tests/test_multi_device.py does, into test_backend_sched.txt
    local src
    src=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["source_tree"])' "$bdir/manifest.json")
    { c++ -std=c++17 -O1 "$src/tests/test-backend-sched.cpp" -o /tmp/test-backend-sched -I"$src/ggml/include" \
          -L"$bdir/bin" -lggml -lggml-base -Wl,-rpath,"$bdir/bin" && tl /tmp/test-backend-sched -d CUDA0; } \
        > "$out/test_backend_sched.txt" 2>&1
    echo "test-backend-sched exit $?" >> "$out/test_backend_sched.txt"
}

case $part in
build)  # HI_BUILD_TESTS=0: the library and tools only (no test-backend-ops etc., ~40 s less)
    if [ -n "${HI_PREBUILT:-}" ]; then  # unpacked in seconds; if it does not run here, compiled as below
        if { time python3 scripts/prebuilt_cuda.py unpack "$HI_PREBUILT" "$bdir" && use_cuda_libs &&
             "$bdir/bin/llama-bench" --list-devices | tee /dev/stderr | grep -q CUDA0; } > "$out/build.log" 2>&1; then
            echo "build exit 0 (prebuilt: $HI_PREBUILT)" >> "$out/build.log"
            exit 0
        fi
        echo "prebuilt $HI_PREBUILT did not run here: compiling" >> "$out/build.log"
        rm -rf "$bdir"
    fi
    if [ "${HI_BUILD_TESTS:-1}" = 0 ]; then
        { time python3 -m pyllama_headinfer build --tools -j 16; } >> "$out/build.log" 2>&1
        echo "build exit $?" >> "$out/build.log"
    else
        { time python3 -m pyllama_headinfer build --tools -j 16 -DLLAMA_BUILD_TESTS=ON; } >> "$out/build.log" 2>&1
        echo "build exit $?" >> "$out/build.log"
        { time ninja -C "$bdir" test-backend-ops test-arg-parser test-llama-archs; } >> "$out/build.log" 2>&1
        echo "test-backend-ops build exit $?" >> "$out/build.log"
    fi
    ;;
checks)
    exactness_fusion_off
    for op in SET_ROWS CONCAT CPY; do
        "$bdir/bin/test-backend-ops" -o "$op" -b CUDA0 2>&1 | grep -E "OK|FAIL|passed|Backend|tests" | tail -4
    done > "$out/test_backend_ops.txt" 2>&1
    # patch 0001's regression test (a context shift of a q8_0 K cache without attention rotation)
    "$bdir/bin/test-llama-archs" -a llama -s 1 > "$out/test_llama_archs.txt" 2>&1
    echo "test-llama-archs exit $?" >> "$out/test_llama_archs.txt"
    if [ -f scripts/gpu_series_check.sh ]; then
        LLAMA_BUILD_DIR=$bdir bash scripts/gpu_series_check.sh "$bdir" > "$out/series_check.txt" 2>&1
        echo "series check exit $?" >> "$out/series_check.txt"
    fi
    ;;
bench)
    bench_model > /dev/null
    mkdir -p "$out/json"
    lb f16_8k_32k -ctk f16 -ctv f16 -hgf 1,0.75,0.5,0.25 -d 8192,32768 -p 0 -n 32 -r 1
    lb q8_0_32k -ctk q8_0 -ctv q8_0 -hgf 1,0.5 -d 32768 -p 0 -n 32 -r 1
    lb q4_0_32k -ctk q4_0 -ctv q4_0 -hgf 1,0.5 -d 32768 -p 0 -n 32 -r 1
    lb ksteps_32k -ctk f16 -ctv f16 -hgf 1,0.5 -d 32768 -p 1,2,4,8,16 -n 0 -r 1
    lb f16_128k -ctk f16 -ctv f16 -hgf 1,0.5 -d 131072 -p 0 -n 16 -r 1 -ub 2048
    lb q8_0_128k -ctk q8_0 -ctv q8_0 -hgf 1 -d 131072 -p 0 -n 16 -r 1 -ub 2048
    python3 scripts/speed_model_check.py --model "$model" "$out"/json/*.json > "$out/speed_model.md" 2>&1
    python3 scripts/shared_prefix_bench.py --model "$model" --depth 32768 --n 1,2,4,8 --fracs 1,0.5 --ngl 99 \
        > "$out/shared_prefix.md" 2>> "$out/bench.err"
    pack_raw "bench_json.tgz" json
    ;;
stream)
    bench_model > /dev/null
    mkdir -p "$out/json"
    lb dec_8k_32k -ctk f16 -ctv f16 -hgf 1,0.75,0.5,0.25 -d 8192,32768 -p 0 -n 32 -r 1
    lb dec_nostream --headinfer-stream off -ctk f16 -ctv f16 -hgf 0.5 -d 8192,32768 -p 0 -n 32 -r 1
    { time python3 scripts/graph_splits.py --model "$model" --ctx 8192,32768,131072 --fracs 1,0.5,0.25; } > "$out/splits.txt" 2>&1
    { echo "== streaming off"; python3 scripts/graph_splits.py --stream off --model "$model" --ctx 131072 --fracs 1,0.5; } >> "$out/splits.txt" 2>&1
    lb dec_128k -ctk f16 -ctv f16 -hgf 1,0.5,0.25 -d 131072 -p 0 -n 16 -r 1 -ub 2048
    lb fill_128k -ctk f16 -ctv f16 -hgf 1,0.5,0.25 -p 131072 -n 0 -r 1 -ub 2048,8192
    pack_raw "stream_json.tgz" json
    ;;
serve)
    # issue 14.6: the build's llama-server (build part, --tools) driven by scripts/server_bench.py
    # (openai client if carried in .whl, else the same requests through urllib). Writes
    # server_load.{md,json}, server_spec.{md,json}, server.log, serve.err.
    draft=/tmp/d1b.gguf  # Llama-3.2-1B shape, the 8B's vocabulary: a draft llama-server accepts
    { time { bench_model
             [ -f "$draft" ] || python3 scripts/make_bench_model.py --out "$draft" --shape 1b; }; } > "$out/serve.err" 2>&1
    export PYTHONUNBUFFERED=1
    sb() { python3 scripts/server_bench.py "$@" --server "$bdir/bin/llama-server" --ngl 99 --server-log "$out/server.log"; }
    # n distinct 8K prompts on n slots, per-slot streams and one unified cache (10 servers)
    { time sb load --model "$model" --frac 1,0.5 --slots 1,2,4 --per-slot --unified \
          --prompt-tokens 8192 --max-tokens 128 --json "$out/server_load.json"; } > "$out/server_load.md" 2>> "$out/serve.err"
    echo "load exit $?" >> "$out/serve.err"
    # one 32K prompt, the 1B-shaped draft whole on the device, K = 4 and 8; zero weights tie, so the
    # acceptance is llama-server's synthetic one (0.8 and 0.6 per token) (10 servers)
    { time sb spec --model "$model" --draft "$draft" --frac 1,0.5 --draft-max 4,8 --synth-accept 0.8,0.6 \
          --prompt-tokens 32768 --max-tokens 128 --json "$out/server_spec.json"; } > "$out/server_spec.md" 2>> "$out/serve.err"
    echo "spec exit $?" >> "$out/serve.err"
    ;;
streams)
    # the series after the 2026-12-03 review: the host stores run last with one KV stream per slot too (patch 0007),
    # and the split layers' heads can be attended per part (patch 0020, headinfer_attn = parts). Exactness with
    # fusion off (joined: bit-identical; parts: how far), decode joined vs parts, compute buffers, slots under load,
    # and one decode step of the 1B-shaped draft at 32K (the speculative loop's drafting). ~5 min; by priority.
    draft=/tmp/d1b.gguf
    { bench_model
      [ -f "$draft" ] || python3 scripts/make_bench_model.py --out "$draft" --shape 1b; } > "$out/streams.err" 2>&1
    export GGML_CUDA_DISABLE_FUSION=1
    for attn in joined parts; do
        echo "== GGML_CUDA_DISABLE_FUSION=1 python3 scripts/gpu_check.py --no-cuda-fusion --attn $attn"
        tl python3 scripts/gpu_check.py --no-cuda-fusion --attn $attn 2>&1 | grep -v "ggml_cuda_init\|Device 0"
        echo "gpu_check exit ${PIPESTATUS[0]}"
    done > "$out/gpu_check.txt"
    { echo "== GGML_CUDA_DISABLE_FUSION=1 python3 scripts/attn_parts_compare.py --no-cuda-fusion"
      tl python3 scripts/attn_parts_compare.py --no-cuda-fusion 2>&1 | grep -v "ggml_cuda_init\|Device 0"; } > "$out/attn_parts.txt"
    unset GGML_CUDA_DISABLE_FUSION
    mkdir -p "$out/json"
    lb dec_joined -ctk f16 -ctv f16 -hgf 1,0.75,0.5,0.25 -d 8192,32768 -p 0 -n 32 -r 1
    lb dec_parts --headinfer-attn parts -ctk f16 -ctv f16 -hgf 1,0.75,0.5,0.25 -d 8192,32768 -p 0 -n 32 -r 1
    { for attn in joined parts; do
          echo "== python3 scripts/graph_splits.py --attn $attn --ctx 8192,32768,131072 --fracs 1,0.75,0.5,0.25"
          tl python3 scripts/graph_splits.py --attn $attn --model "$model" --ctx 8192,32768,131072 --fracs 1,0.75,0.5,0.25
      done
      echo "== python3 scripts/graph_splits.py --ctx 32768 --fracs 1,0.5 --streams 4"
      tl python3 scripts/graph_splits.py --model "$model" --ctx 32768 --fracs 1,0.5 --streams 4; } > "$out/splits.txt" 2>> "$out/streams.err"
    model=$draft lb draft_32k -ctk f16 -ctv f16 -hgf 1 -d 32768 -p 0 -n 32 -r 1
    export PYTHONUNBUFFERED=1
    { time tl python3 scripts/server_bench.py load --model "$model" --frac 0.5 --slots 1,2,4 --per-slot --unified \
          --prompt-tokens 8192 --max-tokens 128 --json "$out/server_load.json" --server "$bdir/bin/llama-server" \
          --ngl 99 --server-log "$out/server.log"; } > "$out/server_load.md" 2>> "$out/streams.err"
    echo "load exit $?" >> "$out/streams.err"
    lb dec_128k_parts --headinfer-attn parts -ctk f16 -ctv f16 -hgf 0.5 -d 131072 -p 0 -n 16 -r 1 -ub 2048
    # the device tool brings back 8 files: the tables stay, the rest is packed
    pack_raw "raw.tgz" json server.log server_load.json bench.err streams.err
    ;;
state)
    # state I/O under the split: exactness on the device (fusion off), then one slot of the 8B shape holding 32K
    # tokens saved and restored through llama-server at frac 1 / 0.5 / 0.25 (slot file in /dev/shm: no disk)
    exactness_fusion_off
    bench_model > "$out/state.err" 2>&1
    { time tl python3 scripts/server_bench.py save --model "$model" --frac 1,0.5,0.25 --prompt-tokens 32768 \
          --repeat 3 --save-dir /dev/shm --json "$out/state_save.json" --server "$bdir/bin/llama-server" --ngl 99 \
          --server-log "$out/state_server.log"; } > "$out/state_save.md" 2>> "$out/state.err"
    echo "save exit $?" >> "$out/state.err"
    ;;
pin)
    # a pin's GPU checks (issue 27: a second pin becomes the default only after these pass): exactness with fusion
    # off, the backend ops the series touches, the K-shift regression test, and decode at 32K against the link
    exactness_fusion_off
    for op in SET_ROWS CONCAT CPY GET_ROWS; do
        echo "== test-backend-ops -o $op -b CUDA0"
        tl "$bdir/bin/test-backend-ops" -o "$op" -b CUDA0 2>&1 | grep -E "FAIL|passed|Backend" | tail -3
    done > "$out/test_backend_ops.txt" 2>&1
    tl "$bdir/bin/test-llama-archs" -a llama -s 1 > "$out/test_llama_archs.txt" 2>&1
    echo "test-llama-archs exit $?" >> "$out/test_llama_archs.txt"
    bench_model > "$out/pin.err" 2>&1
    mkdir -p "$out/json"
    lb dec_32k -ctk f16 -ctv f16 -hgf 1,0.75,0.5,0.25 -d 32768 -p 0 -n 32 -r 1
    python3 scripts/speed_model_check.py --model "$model" "$out"/json/*.json > "$out/speed_model.md" 2>&1
    pack_raw "raw.tgz" json bench.err pin.err
    ;;
params)
    # issue 29.3/29.8: streaming is opt-in (llama_context_params.headinfer_stream), the per-part attention a parameter
    # (headinfer_attn): exactness with fusion off for the default and streaming off, decode at 32K per mode, splits
    exactness_streamed_and_not
    bench_model > "$out/params.err" 2>&1
    mkdir -p "$out/json"
    lb dec_32k -ctk f16 -ctv f16 -hgf 1,0.75,0.5,0.25 -d 32768 -p 0 -n 32 -r 2
    lb dec_32k_off --headinfer-stream off -ctk f16 -ctv f16 -hgf 0.5 -d 32768 -p 0 -n 32 -r 1
    lb dec_32k_parts --headinfer-attn parts -ctk f16 -ctv f16 -hgf 0.5 -d 32768 -p 0 -n 32 -r 1
    { for stream in gpu off; do
          echo "== python3 scripts/graph_splits.py --stream $stream --ctx 32768 --fracs 1,0.5"
          tl python3 scripts/graph_splits.py --stream $stream --model "$model" --ctx 32768 --fracs 1,0.5
      done; } > "$out/splits.txt" 2>> "$out/params.err"
    python3 scripts/speed_model_check.py --model "$model" "$out"/json/dec_32k.json > "$out/speed_model.md" 2>&1
    pack_raw "raw.tgz" json bench.err params.err
    ;;
slots)
    # per-slot streams far from full (4 slots of 32K holding ~8K each): patch 0018 streams the cells in use of each
    # slot, not the cells between them (issue 13.7); per-slot vs unified under the same load, then the 32K decode
    # at f = 0.75 repeated (issue 12's one figure below 95 % of the ceiling). ~3 min.
    bench_model > "$out/slots.err" 2>&1
    { echo "== GGML_CUDA_DISABLE_FUSION=1 python3 scripts/gpu_check.py --no-cuda-fusion"
      GGML_CUDA_DISABLE_FUSION=1 tl python3 scripts/gpu_check.py --no-cuda-fusion 2>&1 | grep -v "ggml_cuda_init\|Device 0"
      echo "gpu_check exit ${PIPESTATUS[0]}"; } > "$out/gpu_check.txt"
    export PYTHONUNBUFFERED=1
    { time tl python3 scripts/server_bench.py load --model "$model" --frac 0.5 --slots 4 --per-slot --unified \
          --ctx 32768 --prompt-tokens 8192 --max-tokens 64 --json "$out/slots_load.json" \
          --server "$bdir/bin/llama-server" --ngl 99 --server-log "$out/slots_server.log"; } > "$out/slots_load.md" 2>> "$out/slots.err"
    echo "load exit $?" >> "$out/slots.err"
    mkdir -p "$out/json"
    lb dec_32k_r3 -ctk f16 -ctv f16 -hgf 1,0.75,0.5 -d 32768 -p 0 -n 32 -r 3
    pack_raw "raw.tgz" json slots_server.log slots_load.json bench.err slots.err
    ;;
writeback)
    # issue 29.1: the host stores of each layer written back from the device (patches 0023, 0024): exactness with
    # fusion off (streamed and not), the decode table of the issue, compute buffers at n_ubatch 2048, host time per step
    exactness_streamed_and_not
    bench_model > "$out/wb.err" 2>&1
    mkdir -p "$out/json"
    lb dec_8k_32k -ctk f16 -ctv f16 -hgf 1,0.75,0.5,0.25 -d 8192,32768 -p 0 -n 32 -r 2
    { echo "== python3 scripts/graph_splits.py --ubatch 2048 --ctx 8192,32768,131072 --fracs 1,0.5,0.25"
      tl python3 scripts/graph_splits.py --model "$model" --ubatch 2048 --ctx 8192,32768,131072 --fracs 1,0.5,0.25
      echo "== --stream off"
      tl python3 scripts/graph_splits.py --stream off --model "$model" --ubatch 2048 --ctx 32768 --fracs 1,0.5; } > "$out/splits.txt" 2>> "$out/wb.err"
    tl python3 scripts/decode_host_time.py --model "$model" --depth 32768 --fracs 1,0.5,0.25 --stream gpu,off \
        > "$out/host_time.md" 2>> "$out/wb.err"
    lb dec_128k -ctk f16 -ctv f16 -hgf 1,0.5,0.25 -d 131072 -p 0 -n 16 -r 1 -ub 2048
    python3 scripts/speed_model_check.py --model "$model" "$out"/json/*.json > "$out/speed_model.md" 2>&1
    pack_raw "raw.tgz" json bench.err wb.err
    ;;
hygiene)
    # issue 29 items 2, 6 and 9 (the cut at the first read of host memory, the split layers' nodes kept in the memory
    # context, set_rows of same-type rows on CUDA, concat's cases): exactness with fusion off, streamed and not; the
    # ops the series touches; concat's perf cases; the scheduler test on CUDA0
    exactness_streamed_and_not
    for op in SET_ROWS CONCAT CPY GET_ROWS; do
        echo "== test-backend-ops -o $op -b CUDA0"
        tl "$bdir/bin/test-backend-ops" -o "$op" -b CUDA0 2>&1 | grep -E "FAIL|passed|Backend" | tail -4
    done > "$out/test_backend_ops.txt" 2>&1
    { echo "== test-backend-ops perf -o CONCAT -b CUDA0"; tl "$bdir/bin/test-backend-ops" perf -o CONCAT -b CUDA0 2>&1 | grep -v "^ggml_cuda_init\|Device 0"; } \
        > "$out/concat_perf.txt" 2>&1
    scheduler_test
    ;;
table)
    # issue 29's table: decode at 8K/32K (-r 2) and 128K, and the compute buffers at n_ubatch 2048
    bench_model > "$out/table.err" 2>&1
    mkdir -p "$out/json"
    lb dec_8k_32k -ctk f16 -ctv f16 -hgf 1,0.75,0.5,0.25 -d 8192,32768 -p 0 -n 32 -r 2
    { echo "== python3 scripts/graph_splits.py --ubatch 2048 --ctx 8192,32768,131072 --fracs 1,0.5,0.25"
      tl python3 scripts/graph_splits.py --model "$model" --ubatch 2048 --ctx 8192,32768,131072 --fracs 1,0.5,0.25; } \
        > "$out/splits.txt" 2>> "$out/table.err"
    lb dec_128k -ctk f16 -ctv f16 -hgf 1,0.5,0.25 -d 131072 -p 0 -n 16 -r 1 -ub 2048
    python3 scripts/speed_model_check.py --model "$model" "$out"/json/*.json > "$out/speed_model.md" 2>&1
    pack_raw "raw.tgz" json bench.err table.err
    ;;
lse)
    # issue 30 on CUDA (ggml_flash_attn_ext_lse): the op against the CPU; chunked mode bit-identical across fractions
    # with fusion off; decode at 32K, the difference to the joined heads at 32K over 256 steps, fill, 128K decode
    # (the buffers: part lsebuf; a call of 585 s does not hold both after a build)
    flash_attn_test_backend_ops
    exactness_fusion_off --attn chunked --attn-chunk 256
    bench_model > "$out/lse.err" 2>&1
    mkdir -p "$out/json"
    lb dec_32k_chunked --headinfer-attn chunked -ctk f16 -ctv f16 -hgf 1,0.5,0.25 -d 32768 -p 0 -n 32 -r 1
    { time tl env GGML_CUDA_DISABLE_FUSION=1 python3 scripts/attn_parts_compare.py --no-cuda-fusion --mode chunked \
          --chunk 8192 --depth 32768 --steps 256 --types f16 --fracs 0.5; } > "$out/chunked_vs_joined.txt" 2>&1
    lb fill_8k_chunked --headinfer-attn chunked -ctk f16 -ctv f16 -hgf 1,0.25 -p 8192 -n 0 -r 1 -ub 2048
    lb dec_128k_chunked --headinfer-attn chunked -ctk f16 -ctv f16 -hgf 0.25 -d 131072 -p 0 -n 16 -r 1 -ub 2048
    python3 scripts/speed_model_check.py --model "$model" "$out"/json/*.json > "$out/speed_model.md" 2>&1
    pack_raw "raw.tgz" json bench.err lse.err
    ;;
lse128)
    # issue 30 at 128K: test-backend-ops for the log-sum-exp attention, then llama-batched-bench (one fill of the
    # context, then decode at its depth: fill and decode speed from one context) in chunked mode, f 0.25 first
    # (HI_TBO=0: no test-backend-ops; HI_BB_CFGS: the attention[/chunk cells]:fraction runs, HI_BB_DEPTH: their context,
    # HI_BB_KV: their KV type)
    if [ "${HI_TBO:-1}" = 1 ]; then
        flash_attn_test_backend_ops
    fi
    bench_model >> "$out/lse.err" 2>&1
    [ -x "$bdir/bin/llama-batched-bench" ] || tl ninja -C "$bdir" llama-batched-bench >> "$out/lse.err" 2>&1
    for cfg in ${HI_BB_CFGS:-chunked:0.25 joined:0.25 chunked:1}; do  # attention[/chunk cells]:fraction
        attn=${cfg%:*}
        bb "${HI_BB_DEPTH:-131072}" --headinfer-attn "${attn%/*}" -hgf "${cfg#*:}" \
            $([ "$attn" = "${attn%/*}" ] || echo --headinfer-attn-chunk "${attn#*/}")
    done
    pack_raw "raw-$(date +%s).tgz" lse.err bb.err
    ;;
lsebuf)
    # issue 30's buffer table: compute buffers at n_ubatch 2048 from 8K to 256K (HI_LSEBUF_CTX: fewer), chunked and joined
    bench_model > "$out/lsebuf.err" 2>&1
    buffer_table "${HI_LSEBUF_CTX:-8192,32768,131072,262144}" lsebuf.err
    ;;
quick29)
    # issue 29's last target alone (32K f 0.75 against frac 1.0, -r 3: the prefetch of both slots), for a session
    # with little device time; `sched` is the whole check
    bench_model > "$out/quick29.err" 2>&1
    mkdir -p "$out/json"
    lb dec_32k_f075 -ctk f16 -ctv f16 -hgf 1,0.75 -d 32768 -p 0 -n 32 -r "${HI_REPS:-3}"  # HI_REPS: fewer when short of time
    pack_raw "raw-quick29.tgz" json bench.err quick29.err
    ;;
sched)
    # the series' scheduler test (ggml only, compiled against the build's libraries as tests/test_multi_device.py
    # does), exactness with fusion off (streamed and not: the prefetch of both slots changes the order of copies),
    # then issue 29's table at 8K and 32K repeated, and 128K at f 0.25 (HI_SCHED_128K=0 skips it)
    scheduler_test
    exactness_streamed_and_not
    bench_model > "$out/sched.err" 2>&1
    mkdir -p "$out/json"
    lb dec_8k_32k_r3 -ctk f16 -ctv f16 -hgf 1,0.75,0.5,0.25 -d 8192,32768 -p 0 -n 32 -r 3
    tl python3 scripts/decode_host_time.py --model "$model" --depth 32768 --fracs 1,0.75,0.25 --stream gpu \
        > "$out/host_time.md" 2>> "$out/sched.err"
    if [ "${HI_SCHED_128K:-1}" = 1 ]; then
        lb dec_128k_r2 -ctk f16 -ctv f16 -hgf 1,0.25 -d 131072 -p 0 -n 16 -r 2 -ub 2048
    fi
    pack_raw "raw.tgz" json bench.err sched.err
    ;;
issue29)
    # issue 29's whole check in one call: the machine's copy rate (before and after), the scheduler test and
    # exactness with fusion off, the decode table at 8K/32K (-r 3) and 128K (every fraction), the compute buffers
    copy_rate before
    scheduler_test
    exactness_fusion_off
    bench_model > "$out/issue29.err" 2>&1
    mkdir -p "$out/json"
    lb dec_8k_32k_r3 -ctk f16 -ctv f16 -hgf 1,0.75,0.5,0.25 -d 8192,32768 -p 0 -n 32 -r "${HI_REPS:-3}"
    lb dec_128k_r1 -ctk f16 -ctv f16 -hgf 1,0.75,0.5,0.25 -d 131072 -p 0 -n 16 -r 1 -ub 2048
    { echo "== python3 scripts/graph_splits.py --ubatch 2048 --ctx 8192,32768,131072 --fracs 1,0.5,0.25"
      tl python3 scripts/graph_splits.py --model "$model" --ubatch 2048 --ctx 8192,32768,131072 --fracs 1,0.5,0.25; } \
        > "$out/splits.txt" 2>> "$out/issue29.err"
    copy_rate "after the table"
    pack_raw "raw-issue29.tgz" json bench.err issue29.err
    ;;
issue30)
    # issue 30's open figures in one call (~8 min), the 256K run first (the one a short call must not lose): exactness
    # in chunks with fusion off (a full cache too); the copy rate before and after 256K q8_0 f 0.125 chunked (fill,
    # decode, buffer, the step times from the verbose log); then, as time allows, chunked 32K (llama-bench at three
    # fractions, and the copy engine's trace at f 0.25: what idles it)
    copy_rate before
    exactness_in_chunks
    bench_model > "$out/issue30.err" 2>&1
    mkdir -p "$out/json"
    HI_BB_KV=q8_0 bb 262144 --headinfer-attn chunked -hgf 0.125
    { echo "== log_step_times.py bb.err"; python3 scripts/log_step_times.py "$out/bb.err"; } >> "$out/bb.md" 2>&1
    copy_rate "after 256K"
    lb dec_32k_chunked --headinfer-attn chunked -ctk f16 -ctv f16 -hgf 1,0.5,0.25 -d 32768 -p 0 -n 32 -r 2
    tl python3 scripts/decode_timeline.py --model "$model" --depth 32768 --frac 0.25 --attn chunked --steps 4 \
        --detail 1 --edge-ms 0.5 > "$out/timeline.md" 2>> "$out/issue30.err"
    pack_raw "raw-issue30.tgz" json bench.err bb.err issue30.err
    ;;
exact)
    # exactness with fusion off, chunked (chunks of 256 cells, a full cache too) then joined, into gpu_check.txt (~30 s)
    exactness_chunked_and_joined
    ;;
w44)
    # patch 0044 (a split ends at its write-backs of a batch's rows) on the GPU (~8 min): test-backend-sched on CUDA0
    # (its batch case), exactness in chunks and joined, the compute buffer table 8K-256K (n_ubatch 2048); the fill
    # against the series before 0044 (HI_VARIANT_LIB: its libggml-base, e.g. .gpu-prebuilt/variant-pre0044): 2048
    # tokens at depth 8K, n_ubatch 2048, f 1 and 0.5, chunked and joined, this / variant / this again; then frac 1.0's
    # 256K q8_0 in chunks (the serial floor of f 0.125's 256K figure)
    scheduler_test
    exactness_chunked_and_joined
    bench_model > "$out/w44.err" 2>&1
    buffer_table 8192,32768,131072,262144 w44.err
    mkdir -p "$out/json"
    if [ -n "${HI_VARIANT_LIB:-}" ]; then
        for which in this variant this2; do
            for attn in chunked joined; do
                LB_ENV=$(run_env $which) lb "fill_8k_${attn}_$which" -ctk f16 -ctv f16 -hgf 1,0.5 --headinfer-attn $attn \
                    -d 8192 -p 2048 -n 0 -b 2048 -ub 2048 -r 2
            done
        done
    fi
    HI_BB_KV=q8_0 bb 262144 --headinfer-attn chunked -hgf 1
    { echo "== log_step_times.py bb.err"; python3 scripts/log_step_times.py "$out/bb.err"; } >> "$out/bb.md" 2>&1
    pack_raw "raw-w44.tgz" json bench.err bb.err w44.err
    ;;
rowmeta)
    # patch 0045 (the log-sum-exp attention of a large batch takes its row sums from the MMA kernel, no pass over K):
    # test-backend-ops for flash attention (its cases of 509-1100 rows take the new path) and 0039's perf cases (one
    # chunk of 8192 cells at 4096 rows: plain, and with the log-sum-exp); exactness with fusion off, chunked and
    # joined; the fill of 2048 tokens at depth 8K and 32K (n_ubatch 2048, f 1 and 0.5): chunked with the kernel's
    # row sums, with the pass over K (GGML_CUDA_FATTN_LSE_PASS=1), with the row sums again, then joined; then
    # chunked against the joined heads at 32K over 256 steps (the prompt's log-sum-exps changed)
    flash_attn_test_backend_ops
    exactness_chunked_and_joined
    bench_model > "$out/rowmeta.err" 2>&1
    mkdir -p "$out/json"
    for which in this pass this2; do
        LB_ENV=$(run_env $which) lb "fill_chunked_$which" --headinfer-attn chunked -ctk f16 -ctv f16 -hgf 1,0.5 \
            -d 8192,32768 -p 2048 -n 0 -b 2048 -ub 2048 -r 2
    done
    lb fill_joined --headinfer-attn joined -ctk f16 -ctv f16 -hgf 1,0.5 -d 8192,32768 -p 2048 -n 0 -b 2048 -ub 2048 -r 2
    lb fill_chunked_q8_0 --headinfer-attn chunked -ctk q8_0 -ctv q8_0 -hgf 1,0.125 -d 32768 -p 2048 -n 0 -b 2048 \
        -ub 2048 -r 2
    { time tl env GGML_CUDA_DISABLE_FUSION=1 python3 scripts/attn_parts_compare.py --no-cuda-fusion --mode chunked \
          --chunk 8192 --depth 32768 --steps 256 --types f16 --fracs 0.5; } > "$out/chunked_vs_joined.txt" 2>&1
    pack_raw "raw-rowmeta.tgz" json bench.err rowmeta.err
    ;;
groups)
    # patch 0046 (a split's streamed inputs in groups of the split, not a split each) against the series before it
    # (HI_VARIANT_LIB: its libggml-base, e.g. .gpu-prebuilt/variant-pre0046): test-backend-sched on CUDA0, exactness
    # with fusion off in chunks and joined; then 128K q8_0 KV at f 0.125 in chunks (the model's 8192 cells: 514 decode
    # splits before), fill and 64 decode steps in llama-batched-bench, this / variant / this again, with the graph
    # splits that llama.cpp logs (~9 min)
    scheduler_test
    exactness_chunked_and_joined
    copy_rate before
    bench_model > "$out/groups.err" 2>&1
    for which in this variant this2; do
        HI_BB_KV=q8_0 BB_ENV=$(run_env $which) bb "${HI_GROUPS_DEPTH:-131072}" --headinfer-attn chunked -hgf 0.125 -ntg 64
    done
    copy_rate after
    pack_raw "raw-groups.tgz" bb.err groups.err
    ;;
groups2)
    # the rest of 0046's comparison (HI_VARIANT_LIB as for groups): the joined default at 128K f 0.25 (34 decode splits
    # before), then 32K in chunks at f 0.25, fill and 64 decode steps each, this / variant / this again (~8 min)
    copy_rate before
    bench_model > "$out/groups2.err" 2>&1
    for which in this variant this2; do
        BB_ENV=$(run_env $which) bb 131072 --headinfer-attn joined -hgf 0.25 -ntg 64
    done
    for which in this variant this2; do
        BB_ENV=$(run_env $which) bb 32768 --headinfer-attn chunked -hgf 0.25 -ntg 64
    done
    copy_rate after
    pack_raw "raw-groups2.tgz" bb.err groups2.err
    ;;
groups256)
    # 256K in chunks with 0045 and 0046: q8_0 KV at f 0.125 and f16 at f 0.25, fill and 32 decode steps in
    # llama-batched-bench (the CUDA0 buffer, the graph splits, and llama.cpp's check of the buffer against its reserve at
    # the end of the run, in bb.err); with HI_VARIANT_LIB, the f16 run again against its libggml-base (~7 min, 9 with it)
    bench_model > "$out/groups256.err" 2>&1
    HI_BB_KV=q8_0 bb 262144 --headinfer-attn chunked -hgf 0.125 -ntg 32
    bb 262144 --headinfer-attn chunked -hgf 0.25 -ntg 32
    if [ -n "${HI_VARIANT_LIB:-}" ]; then
        BB_ENV=$(run_env variant) bb 262144 --headinfer-attn chunked -hgf 0.25 -ntg 4
    fi
    grep "expectation" "$out/bb.err" >> "$out/bb.md"
    copy_rate after
    pack_raw "raw-groups256.tgz" bb.err groups256.err
    ;;
chunks)
    # whether the scheduler's split per chunk costs decode speed (issue 30, item 2): 128K, q8_0 KV at f 0.125 (one
    # resident head), chunked, in chunks of 8192 cells (the model's default: 514 decode splits), 16384 (258) and 32768
    # (130; the arena grows with the chunk); the copy rate before and after, for the ceiling (~6 min; HI_CHUNKS_DEPTH:
    # another context, e.g. 65536 for a short call: 258 / 130 / 66 splits)
    copy_rate before
    bench_model > "$out/chunks.err" 2>&1
    mkdir -p "$out/json"
    depth=${HI_CHUNKS_DEPTH:-131072}
    for chunk in 8192 16384 32768; do
        lb "dec_${depth}_q8_0_chunk$chunk" --headinfer-attn chunked --headinfer-attn-chunk $chunk -ctk q8_0 -ctv q8_0 \
            -hgf 0.125 -d "$depth" -p 0 -n 32 -r 2
    done
    copy_rate after
    pack_raw "raw-chunks.tgz" json bench.err chunks.err
    ;;
row128)
    # issue 29's 128K row at every fraction (-r 1, tg16, -ub 2048; ~1.5 min)
    bench_model > "$out/row128.err" 2>&1
    mkdir -p "$out/json"
    lb dec_128k_r1 -ctk f16 -ctv f16 -hgf 1,0.75,0.5,0.25 -d 131072 -p 0 -n 16 -r 1 -ub 2048
    pack_raw "raw-row128.tgz" json bench.err row128.err
    ;;
variant)
    # this build against another libggml-base (HI_VARIANT_LIB: a directory holding libggml-base.so.0 of the same pin,
    # e.g. the series before a scheduler change), in one run: 32K at frac 1 and 0.75 (-r 3) and the host time per
    # step, this build, the variant, this build again; then whether a small copy waits behind queued ones
    bench_model > "$out/variant.err" 2>&1
    mkdir -p "$out/json"
    for which in this variant this2; do
        which_env=$(run_env $which)
        LB_ENV=$which_env lb "dec_32k_$which" -ctk f16 -ctv f16 -hgf 1,0.75 -d 32768 -p 0 -n 32 -r 3
        { echo "== $which"; tl env $which_env python3 scripts/decode_host_time.py \
            --model "$model" --depth 32768 --fracs 0.75 --stream gpu; } >> "$out/host_time.md" 2>> "$out/variant.err"
    done
    tl python3 scripts/copy_queue_wait.py > "$out/copy_queue_wait.txt" 2>&1
    pack_raw "raw-variant.tgz" json bench.err variant.err
    ;;
timeline)
    # the copy engine's busy and idle time per decoding step (scripts/decode_timeline.py, PyTorch's CUDA trace):
    # joined at 32K f 0.75 (the events at the step boundary listed; against HI_VARIANT_LIB's libggml-base too, if
    # set), chunked at 128K f 0.25 (chunks within the layer)
    bench_model > "$out/timeline.err" 2>&1
    { tl python3 scripts/decode_timeline.py --model "$model" --depth 32768 --frac 0.75 --detail 3 --edge-ms 1.2 \
          --trace "$out/trace-32k.json.gz"
      if [ -n "${HI_VARIANT_LIB:-}" ]; then
          echo "== libggml-base of $HI_VARIANT_LIB"
          tl env "$(variant_env)" python3 scripts/decode_timeline.py --model "$model" \
              --depth 32768 --frac 0.75 --detail 3 --edge-ms 1.2
      fi
      tl python3 scripts/decode_timeline.py --model "$model" --depth 131072 --frac 0.25 --attn chunked --steps 3 \
          --detail 1 --edge-ms 0.4 --trace "$out/trace-128k-chunked.json.gz"; } > "$out/timeline.md" 2>> "$out/timeline.err"
    ;;
ahead)
    # this build against HI_VARIANT_LIB's libggml-base (e.g. the series before a change to the step boundary), in one
    # run: the copy engine at the step boundary at 32K f 0.75 (decode_timeline.py), then llama-bench at frac 1 and 0.75
    bench_model > "$out/ahead.err" 2>&1
    mkdir -p "$out/json"
    for which in this variant; do
        which_env=$(run_env $which)
        { echo "== $which"; tl env $which_env python3 scripts/decode_timeline.py --model "$model" --depth 32768 \
            --frac 0.75 --steps 8 --detail 3 --edge-ms 1.0; } >> "$out/timeline.md" 2>> "$out/ahead.err"
    done
    for which in this variant this2 variant2; do
        LB_ENV=$(run_env $which) lb "dec_32k_$which" -ctk f16 -ctv f16 -hgf 1,0.75 \
            -d 32768 -p 0 -n 32 -r 2
    done
    pack_raw "raw-ahead.tgz" json bench.err ahead.err
    ;;
slots3)
    # patch 0042's third staging slot against two slots (GGML_SCHED_STREAM_SLOTS=2, the same build) in one run: the
    # scheduler test and exactness with fusion off (streamed), issue 29's 32K row alternately with three and two
    # slots, the host time per step, the copy engine at the step boundary (32K f 0.75) with each
    scheduler_test
    exactness_fusion_off
    bench_model > "$out/slots3.err" 2>&1
    mkdir -p "$out/json"
    for which in three two three2 two2; do
        which_env=$(run_env $which)
        LB_ENV=$which_env lb "dec_32k_$which" -ctk f16 -ctv f16 -hgf 1,0.75,0.5,0.25 -d 32768 -p 0 -n 32 -r "${HI_REPS:-2}"
    done
    for which in three two; do
        which_env=$(run_env $which)
        { echo "== $which slots"; tl env $which_env python3 scripts/decode_host_time.py \
            --model "$model" --depth 32768 --fracs 0.75,0.25 --stream gpu; } >> "$out/host_time.md" 2>> "$out/slots3.err"
        { echo "== $which slots"; tl env $which_env python3 scripts/decode_timeline.py --model "$model" \
            --depth 32768 --frac 0.75 --detail 3 --edge-ms 1.2; } >> "$out/timeline.md" 2>> "$out/slots3.err"
    done
    pack_raw "raw-slots3.tgz" json bench.err slots3.err
    ;;
first128)
    # chunked 128K f 0.25: llama-bench's tg16 with three staging slots for its chunks (the default) and two
    # (GGML_SCHED_STREAM_SLOTS=2), then the machine's copy rate and how much it varies (h2d_bandwidth.py)
    bench_model > "$out/first128.err" 2>&1
    mkdir -p "$out/json"
    for which in three two; do
        LB_ENV=$(run_env $which) lb "dec_128k_chunked_$which" -ctk f16 -ctv f16 \
            -hgf 0.25 --headinfer-attn chunked -d 131072 -p 0 -n 16 -r 1 -ub 2048
    done
    tl python3 scripts/h2d_bandwidth.py >> "$out/bench.md" 2>> "$out/first128.err"
    pack_raw "raw-first128.tgz" json bench.err first128.err
    ;;
chunked128)
    # chunked attention at 128K f 0.25: the copy engine per step (decode_timeline.py), then decode in llama-bench,
    # this build and, if HI_VARIANT_LIB is set, with that directory's libraries first (e.g. libllama before a change)
    bench_model > "$out/chunked128.err" 2>&1
    mkdir -p "$out/json"
    tl python3 scripts/decode_timeline.py --model "$model" --depth 131072 --frac 0.25 --attn chunked --steps 3 \
        > "$out/timeline.md" 2>> "$out/chunked128.err"
    args=(-ctk f16 -ctv f16 -hgf 0.25 --headinfer-attn chunked -d 131072 -p 0 -n 16 -r 1 -ub 2048)
    lb dec_128k_chunked "${args[@]}"
    if [ -n "${HI_VARIANT_LIB:-}" ]; then
        LB_ENV=$(variant_env) lb dec_128k_chunked_variant "${args[@]}"
    fi
    pack_raw "raw-chunked128.tgz" json bench.err chunked128.err
    ;;
esac
