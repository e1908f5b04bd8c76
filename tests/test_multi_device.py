"""Layers over several devices (llama.cpp's -sm layer) with the head split, on the CPU.

A machine without GPUs gets two offload devices from two local RPC servers
(ggml's RPC backend, each server a process serving its CPU): the layers are
spread over both, each split layer keeps g/n_head_kv of its heads on its own
device and the rest in host memory. ``scripts/gpu_check.py --rpc 2`` then
checks every logits vector against frac 1.0 on the same two-device layout, and
each device's KV bytes against its own unsplit share.

This needs a build with -DGGML_RPC=ON, made once per session in the cache (the
``rpc_build`` fixture of conftest.py; the two builds cannot share a process, so
the checks run in subprocesses). On two real
GPUs the same script runs with ``--devices CUDA0,CUDA1`` (docs/GPU.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_headinfer.params import ContextParams
from pyllama_headinfer.vram.plan import plan_kv
from testing_models import FORCE_SPLIT, SPECS, write_model

ROOT = Path(__file__).resolve().parents[1]


def rpc_env(rpc_build: Path) -> dict:
    """The environment of a child process that uses the RPC build and this checkout."""
    return dict(os.environ, PYLLAMA_HEADINFER_BUILD_DIR=str(rpc_build), PYTHONPATH=str(ROOT))


def run_split_script(rpc_build: Path, script: str, *args: str, timeout: float = 600,
                     attn: str = "joined") -> subprocess.CompletedProcess:
    """scripts/<script> with the RPC build, its layers split, their heads read ``attn`` (headinfer_attn). RPC devices
    stream the host heads (caps.async_instances), so the checks run the scheduler's streamed path."""
    env = rpc_env(rpc_build)
    args = (*args, "--attn", attn)
    # RPC devices have no pinned host buffer type, so llama.cpp does not split their layers (the host heads would
    # cross the network at every step); the testing knob splits them anyway, to run the split on RPC devices
    env[FORCE_SPLIT] = "1"
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=timeout)


def gpu_check(rpc_build: Path, *args: str, attn: str = "joined") -> subprocess.CompletedProcess:
    return run_split_script(rpc_build, "gpu_check.py", "--rpc", "2", "--no-8b-heads", *args, attn=attn)


def run_split_child(rpc_build: Path, child: str, *args: str, sched_debug: str = "") -> str:
    """``python -c child *args`` with the RPC build, its layers split (and GGML_SCHED_DEBUG=sched_debug): its stdout."""
    env = rpc_env(rpc_build)
    if sched_debug:
        env.update(GGML_SCHED_DEBUG=sched_debug)
    env[FORCE_SPLIT] = "1"
    run = subprocess.run([sys.executable, "-c", child, *args], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run.stdout


def test_layer_split_over_two_devices_is_bit_exact(rpc_build):
    run = gpu_check(rpc_build, "--types", "f16,q8_0", "--fracs", "0.5,0.25")
    out = run.stdout
    assert run.returncode == 0 and out.rstrip().endswith("all checks passed"), out[-3000:] + run.stderr[-2000:]
    assert "devices: RPC0, RPC1 (split mode layer)" in out
    lines = [x for x in out.splitlines() if x.startswith("ok ")]
    assert len(lines) == 3 * 2 * 4 * 2  # models x types x scenarios x fracs
    # the layers really are on both servers: two distinct RPC buffers in one report
    two = [x for x in lines if len({part.split("]")[0] for part in x.split("RPC0[")[1:]}) == 2]
    assert two, "no model had KV on both RPC devices"
    assert all("(headinfer host)" in x for x in lines)


def test_row_split_over_rpc_is_refused_cleanly(rpc_build):
    """-sm row needs split buffers, which RPC devices do not have: llama.cpp refuses the model, nothing runs."""
    run = gpu_check(rpc_build, "--split-mode", "row", "--types", "f16", "--scenarios", "greedy", "--fracs", "0.5")
    assert run.returncode != 0
    assert "does not support split buffers" in run.stderr
    assert "ok " not in run.stdout


def test_rpc_without_the_rpc_backend_is_an_error(llama):
    from pyllama_headinfer.runtime import bindings

    ffi, lib = bindings.load()
    if lib.ggml_backend_reg_by_name(b"RPC") != ffi.NULL:
        pytest.skip("the main build has the RPC backend")
    with pytest.raises(llama.HeadInferError, match="no RPC backend: build with -DGGML_RPC=ON"):
        llama.rpc_add_server("127.0.0.1:50052")


def test_unreachable_rpc_server_is_an_error_not_an_abort(rpc_build):
    """ggml aborts the process when it cannot connect; the check before it turns that into an exception."""
    code = ("import socket\n"
            "from pyllama_headinfer.llama import rpc_add_server, HeadInferError\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
            "try:\n    rpc_add_server(f'127.0.0.1:{port}')\n"
            "except HeadInferError as exc:\n    print('refused:', exc)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=rpc_env(rpc_build), timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused: cannot reach the RPC server 127.0.0.1:" in run.stdout


@pytest.mark.parametrize("endpoint", ["localhost", "127.0.0.1:", ":50052", "127.0.0.1:99999", "h:p", "[::1]:50052"])
def test_rpc_endpoint_must_be_host_port(llama, endpoint):
    with pytest.raises((ValueError, llama.HeadInferError)):
        llama.rpc_add_server(endpoint)


def test_list_devices_has_the_cpu(llama):
    devices = llama.list_devices()
    assert any(d.type == "cpu" for d in devices)
    assert all(d.name and isinstance(d.description, str) for d in devices)


def test_model_placement_arguments_are_checked(llama, gguf_models):
    path = gguf_models["llama-gqa"]
    with pytest.raises(llama.HeadInferError, match="unknown device"):
        llama.Model(path, devices=["NOPE0"])
    with pytest.raises(llama.HeadInferError, match="CPU is not an offload device"):
        llama.Model(path, devices=["CPU"])
    with pytest.raises(ValueError, match="split_mode"):
        llama.Model(path, split_mode="rows")
    with pytest.raises(ValueError, match="devices must be"):
        llama.Model(path, devices="CPU")
    for bad in ([-1.0, 2.0], [float("inf")], [1e39], "12", [0.0, 0.0]):
        with pytest.raises(ValueError, match="tensor_split"):
            llama.Model(path, tensor_split=bad)
    with pytest.raises(ValueError, match="tensor_split must be 1 to 1"):  # one share per named device at most
        llama.Model(path, devices=["CPU"], tensor_split=[1.0, 1.0])
    with llama.Model(path, split_mode="none", tensor_split=[1.0]) as model:  # valid, and harmless on the CPU
        assert model.n_vocab > 0


def graph_report(rpc_build: Path, model: Path, n_ctx: int, n_streams: int = 1) -> dict[float, tuple[int, int, float]]:
    """frac -> (split layers, decode splits, RPC compute buffer MiB), from scripts/graph_splits.py on one RPC device."""
    run = run_split_script(rpc_build, "graph_splits.py", "--model", str(model), "--rpc", "1", "--ctx", str(n_ctx),
                           "--fracs", "1,0.5", "--streams", str(n_streams), timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = {}
    for line in run.stdout.splitlines():
        fields = line.split()
        if fields and fields[0] == str(n_ctx):
            rpc_mib = float(line.split("RPC0[")[1].split("]")[1].split(",")[0])
            report[float(fields[1])] = (int(fields[2]), int(fields[4]), rpc_mib)
    assert set(report) == {1.0, 0.5}, run.stdout
    return report


def test_host_heads_are_copied_one_layer_at_a_time(rpc_build, tmp_path):
    """An offload device reads each split layer's host heads one layer at a time, streamed ahead into the scheduler's
    staging slots (each layer's are a group of the device's one split), so the device's transient memory is one
    layer's worth, the same for a 3- and an 8-layer model; copying them all at once would grow it with the layer count
    (8.6 GiB at 128K on an 8B model). Each layer's host stores follow its attention and are written back from the
    device, so the converted rows that they store are kept for one layer at a time and do not grow with the layer
    count either."""
    from testing_models import SPECS, with_layers, write_model

    models = {spec.n_layer: write_model(spec, tmp_path / spec.filename)
              for spec in (SPECS["llama-gqa"], with_layers(SPECS["llama-gqa"], 8))}
    # one layer's K and V at 16K: 2 x 16384 x 4 heads x 64 x 2 bytes = 16 MiB, half of it in host memory
    growth = {}
    for n_layer, model in models.items():
        report = graph_report(rpc_build, model, 16384)
        (split0, splits0, mib0), (split1, splits1, mib1) = report[1.0], report[0.5]
        assert split0 == 0 and split1 == n_layer
        # no split more: the layers' reads are groups of the device's split, and the scheduler writes the stores
        # back from the device (a host split would add two)
        assert splits1 == splits0, report
        growth[n_layer] = mib1 - mib0
    assert 0 < growth[3] <= 3 * 16, growth
    assert growth[8] == growth[3], growth


def test_host_stores_are_written_back_with_one_kv_stream_per_sequence(rpc_build, gguf_models):
    """With one KV stream per sequence (kv_unified = false, llama-server's -np N) the host stores are written back from
    the device too: no host split, as with one stream (the rows of each stream are written into the joined heads at
    their own indices, which the exactness checks of several streams in test_kv_features verify)."""
    report = graph_report(rpc_build, gguf_models["llama-gqa"], 4096, n_streams=2)
    (split0, splits0, _), (split1, splits1, _) = report[1.0], report[0.5]
    assert split0 == 0 and split1 == 3
    assert splits1 == splits0, report  # the layers' reads are groups of the device's split (0046)


def test_sliding_window_layers_read_their_host_heads_in_groups_of_their_own(rpc_build, gguf_models):
    """iSWA (gemma3: a sliding-window layer's KV is 16 cells padded, a global layer's 4096): every split layer's host
    heads are read in a group of its own (patch 0046; a split of its own before), the small ones too: each streamed
    group copies one layer's K and V, and the groups add no split. (A cut by bytes, at most two of the graph's largest
    inputs per split, copied several small layers' heads with a global layer's K, and their attention waited for
    it.)"""
    report = graph_report(rpc_build, gguf_models["gemma3-iswa"], 4096)
    (split0, splits0, _), (split1, splits1, _) = report[1.0], report[0.5]
    assert split0 == 0 and split1 == 4
    assert splits1 == splits0, report
    stdout = run_split_child(rpc_build, DECODE_STREAMS_CHILD, str(gguf_models["gemma3-iswa"]), "0", sched_debug="1")
    groups = streamed_groups(stdout)
    assert len(groups) == 4 and len({group for group, *_ in groups}) == 4, stdout
    assert len({split for _, split, *_ in groups}) == 1, stdout  # all in the device's one split
    inputs = [names for backend, names in split_inputs(stdout) if backend.startswith("RPC")]
    assert len(inputs) == 1 and sum(name.startswith("cache_") and "_host_l" in name for name in inputs[0]) == 2 * 4, \
        stdout  # each group's copies: the K and V of one layer


# fills the sequences given (argv[2], e.g. "0,1") of a context with one KV stream per sequence far from full on one
# RPC device, decodes one token in each in one batch and prints what llama.cpp logged meanwhile (with GGML_SCHED_DEBUG,
# the scheduler's splits and streamed copies: see streamed_bytes and split_inputs)
DECODE_STREAMS_CHILD = r"""
import sys
sys.path.insert(0, "scripts")
from gpu_check import rpc_servers
from pyllama_headinfer.llama import Context, Model, rpc_add_server
from pyllama_headinfer.runtime.log import capture_log
seqs = [int(s) for s in sys.argv[2].split(",")]
with rpc_servers(1) as endpoints, Model(sys.argv[1], n_gpu_layers=99, devices=rpc_add_server(endpoints[0])) as model:
    with Context(model, n_ctx=1024 * (max(seqs) + 1), n_seq_max=max(seqs) + 1, kv_unified=False, flash_attn=True,
                 n_batch=64, headinfer_gpu_heads_frac=0.5) as ctx:
        for i, seq in enumerate(seqs):
            ctx.decode(list(range(10, 50 - 20 * (i % 2))), seq_id=seq)
        with capture_log() as log:
            ctx.decode_batch({seq: [7 + seq] for seq in seqs})
print("".join(text for _, text in log))
"""


CHUNKED_ON_RPC_CHILD = r"""
import sys, logging
import numpy as np
sys.path.insert(0, "scripts")
from gpu_check import rpc_servers
from pyllama_headinfer.llama import Context, Model, rpc_add_server
from pyllama_headinfer.runtime.log import capture_log
logging.getLogger("pyllama_headinfer.llama").setLevel(logging.INFO)
runs = {}
with rpc_servers(1) as endpoints, Model(sys.argv[1], n_gpu_layers=99, devices=rpc_add_server(endpoints[0])) as model:
    for attn, frac in (("chunked", 1.0), ("chunked", 0.5), ("joined", 0.5)):
        kw = dict(headinfer_attn_chunk=256) if attn == "chunked" else {}
        with capture_log() as log, Context(model, n_ctx=1024, n_batch=256, n_ubatch=256, flash_attn=True,
                                           headinfer_gpu_heads_frac=frac,
                                           headinfer_attn=attn, **kw) as ctx:
            ctx.decode([10 + i % 500 for i in range(600)])  # 600 cells: three chunks of 256 per layer
            steps = []
            for _ in range(4):
                logits = ctx.logits(-1)
                steps.append(logits.tobytes().hex())
                ctx.decode([int(np.argmax(logits))])
        runs[f"{attn} {frac}"] = (steps, "".join(text for _, text in log))
print("chunked 0.5 vs 1.0:", "SAME" if runs["chunked 0.5"][0] == runs["chunked 1.0"][0] else "DIFFERENT")
print("chunked vs joined:", "SAME" if runs["chunked 0.5"][0] == runs["joined 0.5"][0] else "DIFFERENT")
print("== chunked 0.5"); print(runs["chunked 0.5"][1])
print("== joined 0.5"); print(runs["joined 0.5"][1])
"""


def test_chunked_attention_streams_one_chunk_at_a_time_on_rpc_devices(rpc_build, gguf_models):
    """RPC devices ask their server whether it has the log-sum-exp attention (RPC_CMD_SUPPORTS_OP; the CPU server
    of the test has it), so headinfer_attn="chunked" runs on them: the host heads of a split layer are streamed chunk
    by chunk through the scheduler's two staging slots (one chunk each, where the joined heads need the whole layer's
    cells), and every fraction gives frac 1.0's bits within the mode (issue 30 on the streamed path)."""
    out = run_split_child(rpc_build, CHUNKED_ON_RPC_CHILD, str(gguf_models["llama-gqa"]), sched_debug="1")
    assert "chunked 0.5 vs 1.0: SAME" in out, out[-3000:]
    assert "chunked vs joined: DIFFERENT" in out, out[-3000:]  # the chunks are really there: another float order
    assert "one attention per layer instead of chunks" not in out, out[-3000:]
    chunked_log, joined_log = out.split("== chunked 0.5")[1].split("== joined 0.5")
    # llama-gqa: 4 KV heads x 64, f16; at frac 0.5 a cell's host heads are 2 x 64 x 2 = 256 bytes for K, as for V
    row, chunk = 256, 256
    chunked, joined = streamed_bytes(chunked_log), streamed_bytes(joined_log)
    assert chunked and joined, out[-3000:]
    # K and V of one chunk per split, with a neighbouring cell for the rows of other chunks (get_split_chunk)
    assert max(n for n, _ in chunked) == 2 * (chunk + 1) * row, chunked
    assert max(size for _, size in chunked) <= 2 * (chunk + 1) * row, chunked  # a slot holds one chunk
    assert max(n for n, _ in joined) >= 2 * 3 * chunk * row, joined  # the joined heads stream the layer's 600+ cells


CHUNKED_DECODE_SPLITS_CHILD = r"""
import sys
sys.path.insert(0, "scripts")
from gpu_check import rpc_servers
from pyllama_headinfer.llama import Context, Model, rpc_add_server
from pyllama_headinfer.runtime.log import capture_log
with rpc_servers(1) as endpoints, Model(sys.argv[1], n_gpu_layers=99, devices=rpc_add_server(endpoints[0])) as model:
    with Context(model, n_ctx=1024, n_batch=256, n_ubatch=256, flash_attn=True, headinfer_gpu_heads_frac=0.5,
                 headinfer_attn="chunked", headinfer_attn_chunk=256) as ctx:
        ctx.decode([10 + i % 500 for i in range(600)])  # 600 cells: three chunks of 256 per layer
        with capture_log() as log:
            ctx.decode([7])
print("".join(text for _, text in log))
"""


def test_chunked_decode_copies_each_chunks_cell_indices_once_not_once_per_layer(rpc_build, gguf_models):
    """Each chunk of a split layer writes this graph's rows at its block of the cell-index input (get_split_chunk).
    The block is the same for every layer: one view of the input for all layers means one copy to the device per
    chunk and graph. A view per layer was a synchronous copy of 8 bytes per chunk, layer, K and V at the start of
    every decoding step: 1090 of them at 128K cells on an 8B shape, ~13 ms of a 255 ms step on the GPU. The chunks
    are groups of the device's one split (patch 0046), not a split each."""
    out = run_split_child(rpc_build, CHUNKED_DECODE_SPLITS_CHILD, str(gguf_models["llama-gqa"]), sched_debug="2")
    splits = split_inputs(out)
    idxs_copies = sum(inputs.count("attn_inp_k_idxs") for _, inputs in splits)  # views of the input
    assert len(streamed_groups(out)) == 3 * 3, out  # a group per chunk: three chunks in each of the three layers
    assert [backend.startswith("RPC") for backend, _ in splits] == [False, True], splits  # the embeddings, the rest
    assert idxs_copies == 1 + 3, splits  # the stores' view, then one per chunk


BUFFERS_ON_RPC_CHILD = r"""
import sys
sys.path.insert(0, "scripts")
from gpu_check import rpc_servers
from pyllama_headinfer.llama import Context, Model, rpc_add_server
from pyllama_headinfer.runtime.log import capture_log, compute_buffers_mib
with rpc_servers(1) as endpoints, Model(sys.argv[1], n_gpu_layers=99, devices=rpc_add_server(endpoints[0])) as model:
    for attn in ("joined", "chunked"):
        for n_ctx in (4096, 16384):
            for frac in (1.0, 0.5):
                kw = dict(headinfer_attn_chunk=256) if attn == "chunked" else {}
                with capture_log() as log, Context(model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, flash_attn=True,
                                                   headinfer_gpu_heads_frac=frac,
                                                   headinfer_attn=attn, **kw):
                    pass
                sizes = compute_buffers_mib(log)
                print(attn, n_ctx, frac, next(mib for name, mib in sizes.items() if name.startswith("RPC0")))
"""


def test_chunked_attention_bounds_the_device_buffer_with_streaming(rpc_build, gguf_models):
    """Issue 30's bound with the scheduler's streaming on (RPC devices): what a split layer adds to the device's
    compute buffer over frac 1.0 (its staging slots included, patch 0029) grows with the context when it attends in
    one piece (the slots and the joined heads hold the layer's cells) and stays put in chunks (one chunk each)."""
    out = run_split_child(rpc_build, BUFFERS_ON_RPC_CHILD, str(gguf_models["llama-gqa"]))
    mib = {(attn, int(n_ctx), float(frac)): float(size)
           for attn, n_ctx, frac, size in re.findall(r"^(\w+) (\d+) ([0-9.]+) ([0-9.]+)$", out, flags=re.M)}
    assert len(mib) == 8, out
    growth = {attn: (mib[attn, 16384, 0.5] - mib[attn, 16384, 1.0]) - (mib[attn, 4096, 0.5] - mib[attn, 4096, 1.0])
              for attn in ("joined", "chunked")}
    assert growth["joined"] > 8, (growth, mib)  # the layer's heads, staged and joined: ~1 MiB per 1K cells here
    # in chunks: the chunk blocks of the k/v idxs inputs (chunks x n_ubatch x 8 bytes, K and V) and their copies on
    # the device, ~0.75 MiB from 4K to 16K here (1.12 measured)
    assert growth["chunked"] < growth["joined"] / 8, (growth, mib)


MILLION_CELLS_CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, "scripts")
from gpu_check import greedy_steps, rpc_servers
from pyllama_headinfer.llama import Context, Model, rpc_add_server
from pyllama_headinfer.runtime.log import capture_log, compute_buffers_mib
prompt = [(7*i) % 500 + 5 for i in range(300)]
with rpc_servers(1) as endpoints, Model(sys.argv[1], n_gpu_layers=99, devices=rpc_add_server(endpoints[0])) as model:
    for n_ctx in (65536, 1048576):
        steps = {}
        for frac in (1.0, 0.5):
            with capture_log() as log, Context(model, n_ctx=n_ctx, n_batch=512, n_ubatch=64, flash_attn=True,
                                               headinfer_gpu_heads_frac=frac,
                                               headinfer_attn="chunked") as ctx:
                ctx.decode(prompt)
                _, steps[frac] = greedy_steps(ctx, 4)
            sizes = compute_buffers_mib(log)
            print("buffer", n_ctx, frac, next(mib for name, mib in sizes.items() if name.startswith("RPC0")))
        print("logits", n_ctx, "identical" if np.array_equal(np.stack(steps[1.0]), np.stack(steps[0.5])) else "differ")
"""


def test_a_million_cell_context_in_chunks_adds_what_64k_cells_add(rpc_build, gguf_models):
    """Issue 30's headline on an RPC device: a context of 2^20 cells in chunked mode (the model's chunks of 32768
    cells, n_ubatch 64). From 64K to 1M cells the device's compute buffer grows by the KQ mask alone, as stock
    llama.cpp's does (n_ubatch x cells x 2 bytes, the same at frac 1.0), and what the split layers add over frac 1.0
    (their staging slots and joined chunk) stays put at the arena that ``plan`` predicts: 80.1 MiB at 64K and 80.3
    at 1M here (plan: 80.0), against +2048 MiB at 1M joined (measured once; too large to run here). The logits of a
    prompt and 4 greedy steps at frac 0.5 are frac 1.0's."""
    out = run_split_child(rpc_build, MILLION_CELLS_CHILD, str(gguf_models["llama-gqa"]))
    mib = {(int(n), float(f)): float(s) for n, f, s in re.findall(r"^buffer (\d+) ([0-9.]+) ([0-9.]+)$", out, flags=re.M)}
    assert len(mib) == 4, out
    mask_growth = 64 * (1048576 - 65536) * 2 / 2**20  # n_ubatch x cells x F16
    assert abs((mib[1048576, 1.0] - mib[65536, 1.0]) - mask_growth) < 1, (mib, mask_growth)
    added = {n: mib[n, 0.5] - mib[n, 1.0] for n in (65536, 1048576)}
    # llama-gqa's chunk of 32768 cells: three staging slots of its host heads' K and V (2 heads x 64, F16: 16 MiB
    # each) and the joined chunk (4 heads: 32 MiB), what the planner's arena counts (80 MiB), and a few rows
    params = ContextParams(n_ctx=1048576, n_batch=512, n_ubatch=64, flash_attn=True, headinfer_attn="chunked")
    arena = plan_kv(gguf_models["llama-gqa"], params, force_split=True).row_for_frac(0.5).arena / 2**20
    assert arena == 80, arena
    assert arena <= added[65536] < arena + 0.5, (added, arena)
    # what grows is the k/v idxs inputs' chunk blocks (chunks x n_ubatch x 8 bytes, K and V): 32 KiB at 1M cells
    assert abs(added[1048576] - added[65536]) < 1, added
    assert re.findall(r"^logits (\d+) (\w+)$", out, flags=re.M) == [("65536", "identical"), ("1048576", "identical")], out


# a context of argv[2] sequences, one KV stream each (no unified cache), attending in chunks of 1024 cells, at frac 1.0
# and 0.5: the device compute buffer, and the logits of 3 steps of one token in every sequence in one batch
SEQUENCES_CHILD = r"""
import sys
sys.path.insert(0, "scripts")
from gpu_check import rpc_servers
from pyllama_headinfer.llama import Context, Model, rpc_add_server
from pyllama_headinfer.runtime.log import capture_log, compute_buffers_mib
n_seq = int(sys.argv[2])
steps = {}
with rpc_servers(1) as endpoints, Model(sys.argv[1], n_gpu_layers=99, devices=rpc_add_server(endpoints[0])) as model:
    for frac in (1.0, 0.5):
        with capture_log() as log, Context(model, n_ctx=4096 * n_seq, n_seq_max=n_seq, kv_unified=False, n_batch=512,
                                           n_ubatch=512, flash_attn=True, headinfer_gpu_heads_frac=frac,
                                           headinfer_attn="chunked", headinfer_attn_chunk=1024) as ctx:
            for seq in range(n_seq):  # two chunks of each stream in use
                ctx.decode([(7 * i + seq) % 500 + 5 for i in range(1100 + 100 * seq)], seq_id=seq)
            steps[frac] = []
            for step in range(3):
                rows = ctx.decode_batch({seq: [(11 * step + seq) % 500 + 5] for seq in range(n_seq)})
                steps[frac] += [ctx.logits(rows[seq]).tobytes() for seq in range(n_seq)]
        sizes = compute_buffers_mib(log)
        print("buffer", frac, next(mib for name, mib in sizes.items() if name.startswith("RPC0")))
        print("".join(text for _, text in log if "staging buffer" in text))
print("logits", "identical" if steps[1.0] == steps[0.5] else "differ")
"""


def test_several_sequences_in_chunks_stage_what_plan_predicts(rpc_build, gguf_models):
    """Four sequences, one KV stream each (llama-server -np 4 without -kvu), attending in chunks: a chunk of a split
    layer reads its cells of every stream, a strided view of host memory whose span reaches across the streams. A
    staging slot holds the bytes read (a compact copy): one chunk's cells of each of the 4 streams, 2 MiB here, not
    the 3 x 4096 + 1024 cells that the view spans (6.5 MiB), and the device's compute buffer stays within the one
    that ``plan`` predicts for the mode: 19.1 MiB measured at frac 0.5, 21.3 predicted (32.6 MiB with the slots of
    the views' span). The logits of every sequence are frac 1.0's."""
    out = run_split_child(rpc_build, SEQUENCES_CHILD, str(gguf_models["llama-gqa"]), "4")
    mib = {float(f): float(size) for f, size in re.findall(r"^buffer ([0-9.]+) ([0-9.]+)$", out, flags=re.M)}
    assert len(mib) == 2, out
    assert "logits identical" in out, out[-3000:]
    # llama-gqa: 4 KV heads x 64, F16; at frac 0.5 a cell's host K and V are 2 x 2 x 64 x 2 = 512 bytes; a chunk
    # reads 1024 cells of each stream and a neighbouring one (get_split_chunk's spare row)
    slot = 4 * (1024 + 1) * 512
    assert re.findall(r"staging buffer from [0-9.]+ MiB to [0-9.]+ MiB: 3 slots of (\d+) bytes", out) == [str(slot)], out
    assert mib[0.5] - mib[1.0] >= 3 * slot / 2**20, mib
    params = ContextParams(n_ctx=4 * 4096, n_seq_max=4, kv_unified=False, n_batch=512, n_ubatch=512, flash_attn=True,
                           headinfer_attn="chunked", headinfer_attn_chunk=1024)
    plan = plan_kv(gguf_models["llama-gqa"], params, force_split=True)
    for frac in (1.0, 0.5):
        assert mib[frac] <= plan.row_for_frac(frac).compute / 2**20, (frac, mib, plan.row_for_frac(frac).compute)


# a context of argv[2] KV streams of 4096 cells (one per sequence) attending argv[3]ly (chunks of 1024 cells), each
# sequence filled to 3000 cells, then sequence 0 shifted (K-shift) by 1000 positions: what llama.cpp logged about the
# device's buffers while it reserved, then while it shifted and decoded the next token
SHIFT_CHILD = r"""
import sys
sys.path.insert(0, "scripts")
from gpu_check import rpc_servers
from pyllama_headinfer.llama import Context, Model, rpc_add_server
from pyllama_headinfer.runtime.log import capture_log
n_seq, attn = int(sys.argv[2]), sys.argv[3]
with rpc_servers(1) as endpoints, Model(sys.argv[1], n_gpu_layers=99, devices=rpc_add_server(endpoints[0])) as model:
    with capture_log() as reserve_log:
        chunk = {"headinfer_attn_chunk": 1024} if attn == "chunked" else {}
        ctx = Context(model, n_ctx=4096 * n_seq, n_batch=512, n_ubatch=512, flash_attn=True, headinfer_gpu_heads_frac=0.5,
                      headinfer_attn=attn, n_seq_max=n_seq, kv_unified=False, **chunk)
    with ctx:
        for seq in range(n_seq):
            ctx.decode([(7 * i + seq) % 500 + 5 for i in range(3000)], seq_id=seq)
        ctx.seq_rm(0, 10, 1010)
        ctx.seq_add(0, 1010, -1, -1000)
        with capture_log() as log:
            ctx.decode([7])
print("".join(text for _, text in reserve_log if "staging buffer" in text))
print("== shift")
print("".join(text for _, text in log))
"""


def shift_logs(rpc_build: Path, model: Path, n_seq: int, attn: str) -> tuple[str, str]:
    """SHIFT_CHILD's (reserve, shift) logs."""
    reserved, shift_log = run_split_child(rpc_build, SHIFT_CHILD, str(model), str(n_seq), attn).split("== shift")
    assert "applying K-shift" in shift_log, shift_log
    return reserved, shift_log


def test_a_k_shift_in_chunks_stays_in_the_reserved_device_memory(rpc_build, gguf_models):
    """A context shift (K-shift) of a context that attends in chunks rotates the host heads one chunk of cells at a
    time: the scheduler stages one chunk of host K, as for the attention, and neither its staging buffer nor the
    compute buffer grows beyond what the context reserved. Shifted whole, the host K of a layer (4096 cells here) grew
    the staging buffer for the rest of the context. The shift's bits are frac 1.0's in chunks:
    test_layer_split_is_bit_exact_in_chunks (its shift scenario, K F16 and Q8_0)."""
    reserved, shift_log = shift_logs(rpc_build, gguf_models["llama-gqa"], 1, "chunked")
    # the reserve sized the staging buffer: three slots of one chunk's host K and V (1025 cells of 512 bytes)
    assert re.findall(r"staging buffer from [0-9.]+ MiB to [0-9.]+ MiB: 3 slots of (\d+) bytes", reserved) == \
        [str(1025 * 512)], reserved
    assert "staging buffer from" not in shift_log, shift_log
    assert "reallocating" not in shift_log, shift_log


def test_a_k_shift_of_one_of_four_kv_streams_stays_in_the_reserved_device_memory(rpc_build, gguf_models):
    """Joined attention, 4 KV streams (one per sequence, no unified cache), sequence 0 shifted: the shift stages the
    host K of the layer's streams, no more than the attention's reserved host K and V of the same cells (3 slots of
    4 x 4096 cells of 512 bytes), so neither buffer grows."""
    reserved, shift_log = shift_logs(rpc_build, gguf_models["llama-gqa"], 4, "joined")
    assert re.findall(r"staging buffer from [0-9.]+ MiB to [0-9.]+ MiB: 3 slots of (\d+) bytes", reserved) == \
        [str(4 * 4096 * 512)], reserved
    assert "staging buffer from" not in shift_log, shift_log
    assert "reallocating" not in shift_log, shift_log


# the device compute buffer and the graphs' splits (pp, tg) of a context of argv[2] cells at n_ubatch argv[3]
# (default 2048)
BUFFERS_CHILD = r"""
import re, sys
sys.path.insert(0, "scripts")
from gpu_check import rpc_servers
from pyllama_headinfer.llama import Context, Model, rpc_add_server
from pyllama_headinfer.runtime.log import capture_log, compute_buffers_mib
n_ubatch = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
with rpc_servers(1) as endpoints, Model(sys.argv[1], n_gpu_layers=99, devices=rpc_add_server(endpoints[0])) as model:
    for attn in ("chunked", "joined"):
        for frac in (1.0, 0.5, 0.25):
            with capture_log() as log, Context(model, n_ctx=int(sys.argv[2]), n_batch=2048, n_ubatch=n_ubatch,
                                               flash_attn=True, headinfer_gpu_heads_frac=frac,
                                               headinfer_attn=attn):
                pass
            sizes = compute_buffers_mib(log)
            pp, tg = next(m.groups() for _, text in log for m in [re.search(r"splits = (\d+)(?: / (\d+))?", text)] if m)
            print("buffer", attn, frac, next(mib for name, mib in sizes.items() if name.startswith("RPC0")))
            print("splits", attn, frac, pp, tg or pp)
"""


def child_buffers(out: str) -> dict[tuple[str, float], float]:
    """BUFFERS_CHILD's device compute buffers (MiB) by (headinfer_attn, frac): both modes at three fractions."""
    mib = {(attn, float(f)): float(s) for attn, f, s in re.findall(r"^buffer (\w+) ([0-9.]+) ([0-9.]+)$", out, flags=re.M)}
    assert len(mib) == 6, out
    return mib


def test_a_prompts_write_backs_do_not_hold_the_output_out_of_freed_memory(rpc_build, gguf_models):
    """Patch 0044: at a prompt's ubatch (2048 rows) what the split layers add to the device's compute buffer over
    frac 1.0 stays within the arena that ``plan`` predicts (issue 30's target), in chunked and in joined mode. Before
    it, the last layer's write-back rows (its new K and V of the host heads) stayed allocated until the end of their
    split -- after the output -- and lay in memory that the KQ mask's copy had left, so the logits were placed above
    them: 12.1 / 15.6 MiB added at f 0.5 / 0.25 in chunked mode here, against an arena of 10 / 13 (joined: 10.0 /
    13.5); with 0044 6.1 / 9.1 (joined 6.0 / 9.0), the staging slots, the joined heads fitting under the output's
    peak. The prompt's write-backs end their group of the device's split (patch 0046; their split before it): the
    prompt's graph has as many splits as decoding's."""
    out = run_split_child(rpc_build, BUFFERS_CHILD, str(gguf_models["llama-gqa"]), "4096")
    mib = child_buffers(out)
    for attn in ("chunked", "joined"):
        params = ContextParams(n_ctx=4096, n_batch=2048, n_ubatch=2048, flash_attn=True, headinfer_attn=attn)
        plan = plan_kv(gguf_models["llama-gqa"], params, force_split=True)
        for frac in (0.5, 0.25):
            added = mib[attn, frac] - mib[attn, 1.0]
            arena = plan.row_for_frac(frac).arena / 2**20
            # three staging slots of the host heads' K and V of 4096 cells (64 values of F16 a head): 2 MiB a head
            slots = 3 * 4096 * round(4 * (1 - frac)) * 64 * 2 * 2 / 2**20
            assert slots <= added <= arena, (attn, frac, added, slots, arena, mib)
    # the prompt's graph (pp) and decoding's (tg) alike, at every fraction and in both modes
    splits = {(attn, float(f)): (int(pp), int(tg))
              for attn, f, pp, tg in re.findall(r"^splits (\w+) ([0-9.]+) (\d+) (\d+)$", out, flags=re.M)}
    assert len(splits) == 6 and len(set(splits.values())) == 1 and splits["chunked", 1.0][0] == splits["chunked", 1.0][1], \
        splits


def test_plan_estimates_the_compute_buffer_where_the_logits_are_the_peak(rpc_build, tmp_path):
    """``plan``'s compute-buffer estimate against the device's (an RPC device allocates as CUDA does: the H200's
    joined buffers of the 8B shape at 128K and 256K to the MiB, docs/BENCHMARKS.md) for a model whose logits are the
    peak: llama-gqa with a vocabulary of 32000 at n_ubatch 2048 (250 MiB of logits) and 32K cells (128 MiB of KQ
    mask). The device's copy of the mask is freed after the last layer's attention, and the split's transients
    with it (patch 0044 for the write-backs' rows), so the estimate is the larger of the layers plus the masks and the
    output, plus the staging slots: within 5 MiB in both modes at every fraction. Adding the masks to the output (the
    estimate before) over-estimated by 124-132 MiB here, 544 MiB for the 8B shape at 128K."""
    path = write_model(dataclasses.replace(SPECS["llama-gqa"], name="llama-gqa-vocab32k", n_vocab=32000),
                       tmp_path / "llama-gqa-vocab32k.gguf")
    out = run_split_child(rpc_build, BUFFERS_CHILD, str(path), "32768")
    mib = child_buffers(out)
    for attn in ("joined", "chunked"):
        params = ContextParams(n_ctx=32768, n_batch=2048, n_ubatch=2048, flash_attn=True, headinfer_attn=attn)
        plan = plan_kv(path, params, force_split=True)
        for frac in (1.0, 0.5, 0.25):
            estimate = plan.row_for_frac(frac).compute / 2**20
            assert abs(estimate - mib[attn, frac]) <= 5, (attn, frac, estimate, mib)
    # the measuring script says the same without a GPU: KV bytes exact, totals within its 5 %
    run = run_split_script(rpc_build, "plan_check.py", "--rpc", "-m", str(path), "--ctx", "32768", "--fracs", "1,0.5",
                           "--ubatch", "2048", attn="chunked")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "(within 5%); device KV bytes exact in every run" in run.stdout, run.stdout[-3000:]


def test_plan_counts_the_spare_row_of_a_chunk_that_is_the_whole_cache(rpc_build, gguf_models):
    """In chunked mode a split layer's chunk takes a batch's rows of other chunks in a spare row, a neighbouring cell
    joined with the chunk's; a chunk that is the whole cache (a context within ``headinfer_attn_chunk``, here
    llama-gqa's 32768 cells at n_ctx 32768) has none, so its joined K, then V, is copied with a row appended while it
    is alive (patch 0034): 16 MiB more on the device here, which ``plan`` under-counted (estimate 119.3 MiB against
    131.0 at f 0.5, the split adding 95.0 MiB against an arena of 80). At n_ubatch 512 the layers are the peak."""
    path = gguf_models["llama-gqa"]
    mib = child_buffers(run_split_child(rpc_build, BUFFERS_CHILD, str(path), "32768", "512"))
    params = ContextParams(n_ctx=32768, n_batch=2048, n_ubatch=512, flash_attn=True, headinfer_attn="chunked")
    plan = plan_kv(path, params, force_split=True)
    for frac in (0.5, 0.25):
        row = plan.row_for_frac(frac)
        estimate, arena = row.compute / 2**20, row.arena / 2**20
        assert mib["chunked", frac] <= estimate <= mib["chunked", frac] + 5, (frac, estimate, mib)
        added = mib["chunked", frac] - mib["chunked", 1.0]
        assert added <= arena <= added + 2, (frac, added, arena, mib)


def streamed_groups(log: str) -> list[tuple[int, int, int, int, int, int]]:
    """(group, split, bytes streamed, slot, slots, slot size) of each group of a split that streams inputs
    (GGML_SCHED_DEBUG=1: "group #g of split #i streams N bytes into slot s of n (S bytes)", patch 0046)."""
    pattern = r"group #(\d+) of split #(\d+) streams (\d+) bytes into slot (\d) of (\d) \((\d+) bytes\)"
    return [tuple(int(x) for x in found) for found in re.findall(pattern, log)]


def streamed_bytes(log: str) -> list[tuple[int, int]]:
    """(bytes streamed, slot size) of each streamed group."""
    return [(n, size) for _, _, n, _, _, size in streamed_groups(log)]


def first_groups(log: str) -> dict[int, int]:
    """split -> its first group (GGML_SCHED_DEBUG=1: "## GROUP #g of split #i" before each group's nodes)."""
    res: dict[int, int] = {}
    for group, split in re.findall(r"## GROUP #(\d+) of split #(\d+)", log):
        res.setdefault(int(split), int(group))
    return res


def split_inputs(log: str) -> list[tuple[str, list[str]]]:
    """(backend, names of the inputs) of each split (GGML_SCHED_DEBUG=2: "## SPLIT #i: BACKEND # n inputs:[name
    (size)]...")."""
    return [(backend.split("[")[0], re.findall(r"\[([^(]+?) \(", inputs or ""))
            for backend, inputs in re.findall(r"## SPLIT #\d+: (\S+) # \d+ inputs(?::((?:\[[^]]*\])*))?", log)]


def test_streamed_host_heads_skip_the_cells_between_kv_streams(rpc_build, gguf_models):
    """With one KV stream per sequence and a ubatch over two streams, a split layer's host heads are read as a view of
    the first n_kv cells of both; the scheduler streams those cells of each stream, not the rest of the first stream
    that lies between them in host memory, into a compact copy: the staging slot holds the bytes streamed, not the
    view's span (the exactness with stale bytes in between is gpu_check's streams scenario,
    test_layer_split_over_two_devices_is_bit_exact)."""
    stdout = run_split_child(rpc_build, DECODE_STREAMS_CHILD, str(gguf_models["llama-gqa"]), "0,1", sched_debug="1")
    splits = streamed_bytes(stdout)
    # llama-gqa: 3 layers of 4 KV heads x 64, f16; at frac 0.5 each row of the host heads is 2 x 64 x 2 = 256 bytes.
    # n_kv is 256 (the attention's padding; both sequences use fewer cells), each stream has 1024 cells: K and V of
    # both streams' first 256 cells are streamed and staged, not the 1024 + 256 cells that the views span
    row, n_kv = 256, 256
    assert len(splits) == 3, stdout
    for streamed, slot in splits:
        assert streamed == 2 * 2 * n_kv * row, splits
        assert slot == streamed, splits  # a copy as compact as its bytes


def test_streams_of_sequences_not_in_the_ubatch_are_not_streamed(rpc_build, gguf_models):
    """Sequences 0 and 2 of three, one KV stream each, decoded in one batch: llama.cpp splits a batch over several KV
    streams into ubatches of consecutive sequences (llama_batch_allocr::split_equal, sequential), so the two go in
    two ubatches and each streams its own stream's cells only; stream 1, between them, is never copied (issue 29.7:
    a ubatch's view [s0, s1] never spans a stream that is not in it)."""
    stdout = run_split_child(rpc_build, DECODE_STREAMS_CHILD, str(gguf_models["llama-gqa"]), "0,2", sched_debug="1")
    splits = streamed_bytes(stdout)
    # two ubatches of 3 split layers, each copying K and V of n_kv = 256 cells of one stream, 256-byte rows
    row, n_kv = 256, 256
    assert len(splits) == 2 * 3, stdout
    assert all(streamed == 2 * n_kv * row for streamed, _ in splits), splits


def test_host_heads_are_copied_two_layers_ahead_in_three_small_slots(rpc_build, gguf_models):
    """While a layer's host heads are small (patch 0042: at most 128 MiB), the scheduler stages them in three slots
    and copies them two split layers ahead: the first two layers' at the end of the step before (the second one's
    while the host prepares the next step), the third one's at the device's first group, right after its graph
    inputs are copied, rather than when the first layer's attention starts (after the device's work before it is
    queued: 0.14 ms of idle copy engine per step on the H100, docs/BENCHMARKS.md). Each layer's copies are a group
    of the device's one split (patch 0046)."""
    stdout = run_split_child(rpc_build, DECODE_STREAMS_CHILD, str(gguf_models["llama-gqa"]), "0", sched_debug="1")
    streamed = streamed_groups(stdout)
    assert [(slot, n) for _, _, _, slot, n, _ in streamed] == [(0, 3), (1, 3), (2, 3)], stdout  # 3 layers, 64 KiB each
    layers = [group for group, *_ in streamed]
    first_device = next(i for i, (backend, _) in enumerate(split_inputs(stdout)) if backend.startswith("RPC"))
    assert {split for _, split, *_ in streamed} == {first_device}, stdout
    first_group = first_groups(stdout)[first_device]
    assert first_group < layers[0], stdout
    starts = [(int(a), int(b)) for a, b in re.findall(r"group #(\d+) starts the copies of group #(\d+)", stdout)]
    assert starts == [(first_group, layers[2])], stdout
    assert (f"the next computation's group #{layers[0]} prefetched at the start of group #{layers[2]}, "
            "the next one at its end") in stdout


# decodes one token after a short fill of an 8-layer model whose layers are split over two RPC devices (layer split
# mode: the first half on RPC0, the rest on RPC1) and prints what llama.cpp logged meanwhile
TWO_DEVICE_DECODE_CHILD = r"""
import sys
sys.path.insert(0, "scripts")
from gpu_check import rpc_servers
from pyllama_headinfer.llama import Context, Model, rpc_add_server
from pyllama_headinfer.runtime.log import capture_log
with rpc_servers(2) as endpoints, \
        Model(sys.argv[1], n_gpu_layers=99, devices=[d for e in endpoints for d in rpc_add_server(e)]) as model:
    with Context(model, n_ctx=1024, flash_attn=True, n_batch=64, headinfer_gpu_heads_frac=0.5) as ctx:
        ctx.decode(list(range(10, 50)))
        with capture_log() as log:
            ctx.decode([7])
print("".join(text for _, text in log))
"""


def test_host_heads_of_two_devices_share_one_chain_of_slots(rpc_build, tmp_path):
    """Layers split over two devices: each device stages its split layers' host heads in slots of its own, but the
    copies run ahead by positions in one chain of the streamed groups of both devices (patches 0042, 0046), so every
    device gets the same number of slots (three here: small slots) and its slots are taken in turn by its own layers;
    a copy for a layer of the other device stays at the group two positions before it (patch 0043 moves only the first
    copies of a device's own chain to its first group); and the next step's prefetch is the first device's, from its
    last group. Each device computes one split.
    The exactness of the same setup is test_layer_split_over_two_devices_is_bit_exact's."""
    from testing_models import SPECS, with_layers, write_model

    model = write_model(with_layers(SPECS["llama-gqa"], 8), tmp_path / "llama-gqa-8l.gguf")
    stdout = run_split_child(rpc_build, TWO_DEVICE_DECODE_CHILD, str(model), sched_debug="2")
    # each server's device is its RPC0: the backends differ by endpoint ("RPC0[127.0.0.1:PORT]")
    backends = re.findall(r"## SPLIT #\d+: (\S+) #", stdout)
    streamed = streamed_groups(stdout)
    chain = [group for group, *_ in streamed]
    assert len(chain) == 8, stdout
    devices = [backends[split] for _, split, *_ in streamed]
    assert len({split for _, split, *_ in streamed}) == 2, stdout
    # the first layers on one device, the others on the other one
    assert devices[0].startswith("RPC") and len(set(devices)) == 2 and devices == sorted(devices, key=devices.index), \
        stdout
    assert {n for *_, n, _ in streamed} == {3}, stdout
    for device in set(devices):
        slots = [slot for (_, _, _, slot, _, _), d in zip(streamed, devices) if d == device]
        assert slots == [k % 3 for k in range(len(slots))], (device, stdout)

    starts = dict((int(a), int(b)) for a, b in re.findall(r"group #(\d+) starts the copies of group #(\d+)", stdout))
    first_device_group = first_groups(stdout)[backends.index(devices[0])]
    expected = {first_device_group: chain[2]} if devices[2] == devices[0] else {chain[0]: chain[2]}
    expected.update({chain[k]: chain[k + 2] for k in range(1, len(chain) - 2)})
    assert starts == expected, stdout
    last_of_first = max(group for group, d in zip(chain, devices) if d == devices[0])
    assert re.search(rf"the next computation's group #{chain[0]} prefetched at the (start|end) of group "
                     rf"#{last_of_first}", stdout), stdout


def test_index_views_are_copied_at_the_first_device_split(rpc_build, gguf_models):
    """With one KV stream per sequence, every split layer reads the ubatch's cell indices through views of the index
    inputs. Views of graph inputs are copied when the device's first split starts, as the inputs themselves (patch
    0025): copied where they are first read, each copy of a later split would wait there for the device's work queued
    before it (a synchronisation per layer on CUDA). The layers' host heads are streamed, one group of the device's
    split each (patch 0046): the device computes one split, which copies every other input when it starts."""
    stdout = run_split_child(rpc_build, DECODE_STREAMS_CHILD, str(gguf_models["llama-gqa"]), "0,1", sched_debug="2")
    device = [inputs for backend, inputs in split_inputs(stdout) if backend.startswith("RPC")]
    assert len(device) == 1, stdout
    assert sum("idxs" in name for name in device[0]) >= 2 * 3, stdout  # K and V indices of every layer
    assert [name for name in device[0] if "_host_l" in name] == \
        [f"cache_{kv}_host_l{il}" for il in range(3) for kv in "kv"], stdout
    assert len(streamed_groups(stdout)) == 3, stdout


# one context on one RPC device, the decode graph reused from token to token: the scheduler prefetches the first split
# layer's host heads for the next token (patch 0026); a state read into the same context replaces them (patch 0027)
STATE_OVER_PREFETCH_CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, "scripts")
from gpu_check import rpc_servers
from pyllama_headinfer.llama import Context, Model, rpc_add_server
with rpc_servers(1) as endpoints, Model(sys.argv[1], n_gpu_layers=99, devices=rpc_add_server(endpoints[0])) as model:
    p1, p2 = list(range(10, 50)), list(range(60, 100))  # same length: the same graphs
    with Context(model, n_ctx=512, flash_attn=True, n_batch=64, headinfer_gpu_heads_frac=0.5) as ctx:
        ctx.decode(p1)
        state = ctx.save_state()
        ctx.decode([7])
        reference = ctx.logits()
        ctx.clear()
        ctx.decode(p2)
        ctx.decode([7])
        ctx.decode([8])  # the reused one-token graph; its first host heads prefetched with p2's rows
        ctx.load_state(state)  # p1's rows instead
        ctx.decode([7])
        print("identical" if np.array_equal(ctx.logits(), reference) else "differ")
"""


def test_a_state_read_replaces_prefetched_host_heads(rpc_build, gguf_models):
    """The host heads of the first split layer, prefetched for the next token while the device finishes this one
    (patch 0026), are discarded when a state is read into the context (patch 0027): the next token sees the state's
    rows, bit for bit as when the state was saved."""
    stdout = run_split_child(rpc_build, STATE_OVER_PREFETCH_CHILD, str(gguf_models["llama-gqa"]))
    assert stdout.split()[-1] == "identical", stdout[-2000:]


def test_scheduler_streaming_test(rpc_build, tmp_path):
    """The series' own scheduler test, written for upstream (tests/test-backend-sched.cpp, ggml only; compiled here
    against the RPC build's libraries): streamed inputs, stores written back from the device and the prefetch of the
    next computation give the bytes of the scheduler without streaming, on a local RPC server's device,
    ggml_backend_sched_reserve_size() predicts the compute buffer that is allocated, an eval callback sees the
    same nodes streamed and not, the stores into host memory among them, the views of several KV streams are staged
    as compact copies, and a second scheduler that reads the host memory another one writes (two contexts that share
    a KV cache) sees every write when it does not prefetch (PR 4 of docs/UPSTREAM.md)."""
    source = Path(re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", (rpc_build / "CMakeCache.txt").read_text(),
                            flags=re.M).group(1))
    binary = tmp_path / "test-backend-sched"
    cxx = os.environ.get("CXX", "c++")
    build = subprocess.run([cxx, "-std=c++17", "-O1", str(source / "tests" / "test-backend-sched.cpp"), "-o", str(binary),
                            f"-I{source / 'ggml' / 'include'}", f"-L{rpc_build / 'bin'}", "-lggml", "-lggml-base",
                            f"-Wl,-rpath,{rpc_build / 'bin'}"], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    child = ("import subprocess, sys\n"
             "sys.path.insert(0, 'scripts')\n"
             "from gpu_check import rpc_servers\n"
             "with rpc_servers(1) as endpoints:\n"
             "    sys.exit(subprocess.run([sys.argv[1], '--rpc', endpoints[0]], timeout=300).returncode)\n")
    run = subprocess.run([sys.executable, "-c", child, str(binary)], cwd=ROOT, capture_output=True, text=True,
                         env=rpc_env(rpc_build), timeout=600)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("OK"), run.stdout[-2000:] + run.stderr[-2000:]
    assert "device: RPC0" in run.stdout
    assert "4 layers, an eval callback: 180 nodes seen streamed and not, 24 stores among them" in run.stdout
    assert re.search(r"^4 layers, 4 streams: device compute buffer: \d+ bytes without streaming, (\d+) streamed "
                     r"\(\1 for streams without gaps\)$", run.stdout, flags=re.M), run.stdout
    assert "4 layers, a second scheduler reads: without prefetch every step as without streaming; with prefetch 2 of " \
        "3 steps stale" in run.stdout


def test_layer_split_is_bit_exact_in_chunks(rpc_build):
    """headinfer_attn="chunked" on two RPC devices (patch 0037 lets them run it): greedy decoding, a state saved and
    read, a K-shift, two KV streams and a cache filled to its last cell (whose last chunk ends the cache: its spare
    row comes before it) give frac 1.0's bits in the mode, the host heads streamed chunk by chunk."""
    run = gpu_check(rpc_build, "--types", "f16,q8_0", "--fracs", "0.5,0.25", "--attn-chunk", "256",
                    "--scenarios", "greedy,state,shift,streams,full", attn="chunked")
    out = run.stdout
    assert run.returncode == 0 and out.rstrip().endswith("all checks passed"), out[-3000:] + run.stderr[-2000:]
    assert sum(x.startswith("ok ") and " full " in x for x in out.splitlines()) == 3 * 2 * 2, out[-3000:]


def test_quantized_weights_stream_bit_exact(rpc_build, gguf_models, tmp_path):
    """Q4_K/Q6_K weights (llama.cpp's quantizer) on two RPC devices with the host heads streamed and prefetched, joined
    and in chunks: the synthetic models' F16 weights never reach the quantized matrix kernels, so the streamed path
    runs here beside them once (greedy, state, K-shift, two KV streams; frac 1.0's bits)."""
    import gguf

    from pyllama_headinfer.llama import quantize_model

    models = tmp_path / "models"
    models.mkdir()
    path = quantize_model(gguf_models["llama-gqa"], models / "llama-gqa-q4_k_m.gguf", "q4_k_m", n_threads=2)
    assert {"Q4_K", "Q6_K"} <= {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    for attn, extra in (("joined", ()), ("chunked", ("--attn-chunk", "256"))):
        run = gpu_check(rpc_build, "--models", str(models), "--types", "f16,q8_0", "--fracs", "0.5", *extra, attn=attn)
        out = run.stdout
        assert run.returncode == 0 and out.rstrip().endswith("all checks passed"), attn + out[-3000:] + run.stderr[-2000:]
        assert sum(x.startswith("ok   llama-gqa-q4_k_m") for x in out.splitlines()) == 2 * 4, out[-3000:]
