#!/usr/bin/env bash
# The GPU benchmark behind docs/BENCHMARKS.md: llama-bench on an 8B-shaped model.
#
#   python -m pyllama_headinfer build --tools -j 16     # CUDA build with llama-bench (-hgf from the series)
#   scripts/bench_gpu.sh OUTDIR [short|long|baselines|pageable|all]
#
# short:     frac 1, 0.75, 0.5, 0.25 at depths 4K and 32K: pp512 and tg32, 2 repetitions
# long:      the same fractions at 128K: tg32 only, 1 repetition (each fill streams TBs through PCIe)
# baselines: upstream's --no-kv-offload (-nkvo 1) at 4K: tg16
# pageable:  frac 0.5 at 32K with GGML_CUDA_NO_PINNED=1 (the host halves in ordinary, pageable memory)
#
# Each llama-bench table goes to OUTDIR/<part>.md, its full output to OUTDIR/<part>.log.
set -euo pipefail

out=${1:?usage: $0 OUTDIR [short|long|baselines|pageable|all]}
part=${2:-all}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bench=${LLAMA_BENCH:-$root/build/cuda-sm90/bin/llama-bench}
model=${BENCH_MODEL:-$out/b8.gguf}
mkdir -p "$out"

[ -f "$model" ] || python3 "$root/scripts/make_bench_model.py" --out "$model"

run() {  # name, then llama-bench arguments
    local name=$1
    shift
    echo "== $name: llama-bench -m $(basename "$model") $*" | tee "$out/$name.log"
    "$bench" -m "$model" -ngl 99 -fa 1 "$@" 2>&1 | tee -a "$out/$name.log" | grep '^|' | tee "$out/$name.md"
}

case $part in short|all) run short -hgf 1,0.75,0.5,0.25 -d 4096,32768 -p 512 -n 32 -r 2 ;; esac
case $part in long|all) run long -hgf 1,0.75,0.5,0.25 -d 131072 -p 0 -n 32 -r 1 ;; esac
case $part in baselines|all) run nkvo -nkvo 1 -d 4096 -p 0 -n 16 -r 1 ;; esac
case $part in pageable|all) GGML_CUDA_NO_PINNED=1 run pageable -hgf 0.5 -d 32768 -p 0 -n 32 -r 1 ;; esac
