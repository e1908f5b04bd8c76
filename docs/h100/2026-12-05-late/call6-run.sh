# one device call: 0044's libggml-base (this directory) against the carried build's (0043): scheduler test and
# exactness with 0044, then h200_session.sh's part `ahead` (the step boundary's trace and 32K llama-bench, alternating)
set -u
out=$1
V=$(cd "$(dirname "$0")" && pwd)
HI_PREBUILT=.gpu-prebuilt/cuda-sm90.tar.xz bash scripts/h200_session.sh "$out" build
export PYTHONPATH=/tmp/site:$PWD
bdir=$PWD/build/cuda-sm90
src=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["source_tree"])' "$bdir/manifest.json")
{ c++ -std=c++17 -O1 "$V/test-backend-sched.cpp" -o /tmp/tbs4 -I"$src/ggml/include" -L"$bdir/bin" -lggml -lggml-base \
      -Wl,-rpath,"$bdir/bin" && LD_LIBRARY_PATH=$V timeout 60 /tmp/tbs4 -d CUDA0; echo "test-backend-sched (0044) exit $?"; } \
    > "$out/test_backend_sched.txt" 2>&1
{ LD_LIBRARY_PATH=$V GGML_CUDA_DISABLE_FUSION=1 timeout 60 python3 scripts/gpu_check.py --no-cuda-fusion; echo "gpu_check (0044) exit $?"; } \
    > "$out/gpu_check.txt" 2>&1
HI_VARIANT_LIB=$V bash scripts/h200_session.sh "$out" ahead
python3 scripts/h2d_bandwidth.py > "$out/h2d.txt" 2>&1
