#!/usr/bin/env bash
# GPU checks of the patch series (issues 13 and 16) that CPU CI cannot run. Under 3 minutes on an H200.
#
#   scripts/gpu_series_check.sh BUILD_DIR
#
# BUILD_DIR: a CUDA build of the patched tree with tests and tools, e.g.
#   SRC=$(python -m pyllama_headinfer source path)       # the cached tree, series applied by `build`
#   cmake -S "$SRC" -B /tmp/hi-cuda -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=ON
#   ninja -C /tmp/hi-cuda test-backend-ops test-arg-parser llama-bench
#
# Checks (one "ok"/"FAIL" line each; exit 1 if any failed):
#   - test-backend-ops -b CUDA0 for SET_ROWS (13.8: same-type rows are refused by CUDA's supports_op, the other
#     cases pass), CONCAT (patch 3) and CPY;
#   - test-arg-parser (16.6: strict -hgf), llama-bench's strict -hgf list (16.6/13.10);
#   - with a tiny synthetic model and llama-bench -v: the split happens on the discrete GPU with the host heads in
#     CUDA_Host (13.3, 16.5 info line); with GGML_CUDA_NO_PINNED=1 the fallback to pageable memory is a warning
#     (13.4); -sm tensor ignores the fraction with a warning (13.3).
set -u
B=${1:?usage: $0 BUILD_DIR}
BIN=$B/bin
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0

report() {  # report NAME STATUS [DETAIL]
    if [ "$2" = 0 ]; then echo "ok   $1"; else echo "FAIL $1 ${3:-}"; fail=1; fi
}

# 1. upstream's op tests on the GPU
for op in SET_ROWS CONCAT CPY; do
    "$BIN/test-backend-ops" -b CUDA0 -o "$op" > "$TMP/tbo-$op.log" 2>&1
    rc=$?
    report "test-backend-ops -b CUDA0 -o $op ($(grep -Eo '[0-9]+/[0-9]+ tests passed' "$TMP/tbo-$op.log" | head -1))" $rc \
        "$(grep -m3 FAIL "$TMP/tbo-$op.log")"
done

# 2. flag parsing
# its last part downloads from ggml.ai: without network it fails there, after every parsing test has passed
"$BIN/test-arg-parser" > "$TMP/arg.log" 2>&1
rc=$?
if [ $rc -ne 0 ] && grep -q "test-arg-parser: test download functions" "$TMP/arg.log"; then rc=0; fi
report "test-arg-parser (parsing parts; -hgf strict, help width)" $rc "$(tail -3 "$TMP/arg.log")"
for bad in abc '' 1e-45 0.5x 1.5 '0.5,x'; do
    "$BIN/llama-bench" -m /nonexistent.gguf -hgf "$bad" > "$TMP/bench-bad.log" 2>&1
    rc=$?
    grep -q "expected fractions in \[0, 1\]" "$TMP/bench-bad.log" && [ $rc -ne 0 ]
    report "llama-bench -hgf '$bad' is an error with the valid range" $? "$(head -2 "$TMP/bench-bad.log")"
done

# 3. the split on the GPU, as llama.cpp logs it
MODEL=$TMP/llama-gqa.gguf
PYTHONPATH=$ROOT:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH} ${PYTHON:-python3} -c "
from pathlib import Path
from testing_models import SPECS, write_model
write_model(SPECS['llama-gqa'], Path('$MODEL'))" || { report "write the test model" 1; exit 1; }

bench() {  # bench LOG [ENV...] -- [ARGS...]: llama-bench -v on the tiny model, one short run
    local log=$1; shift
    env "$@" "$BIN/llama-bench" -v -m "$MODEL" -p 0 -n 4 -r 1 -fa 1 -ngl 99 -hgf 0.5 > "$log" 2>&1
}

bench "$TMP/split.log"
grep -q "headinfer: gpu_heads_frac = 0.500, 3 of 3 layers split; their KV:" "$TMP/split.log" && \
    grep -q "CUDA_Host KV buffer size = .* (headinfer host heads)" "$TMP/split.log"
report "discrete GPU: 3 of 3 layers split, host heads in CUDA_Host, one info line" $? \
    "$(grep -m4 headinfer "$TMP/split.log")"

bench "$TMP/nopinned.log" GGML_CUDA_NO_PINNED=1
grep -q "headinfer: .* MiB of CUDA_Host memory could not be allocated, using CPU memory instead" "$TMP/nopinned.log"
report "GGML_CUDA_NO_PINNED=1: the pageable fallback is a warning with its size" $? \
    "$(grep -m4 headinfer "$TMP/nopinned.log")"

env "$BIN/llama-bench" -v -m "$MODEL" -p 0 -n 4 -r 1 -fa 1 -ngl 99 -hgf 0.5 -sm tensor > "$TMP/tensor.log" 2>&1
if grep -q "layers not split: tensor split mode" "$TMP/tensor.log"; then
    report "-sm tensor: the fraction is ignored with a warning" 0
elif grep -qi "tensor.*not\( \)*\(implemented\|supported\)\|needs >= 1 devices" "$TMP/tensor.log"; then
    echo "skip -sm tensor: not available here ($(grep -m1 -i tensor "$TMP/tensor.log"))"
else
    report "-sm tensor: the fraction is ignored with a warning" 1 "$(grep -m4 -i 'headinfer\|tensor' "$TMP/tensor.log")"
fi

[ $fail = 0 ] && echo "all GPU series checks passed"
exit $fail
