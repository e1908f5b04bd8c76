"""llama.cpp's own memory fitting (``--fit``, on by default) choosing the split, on a machine without a GPU.

When the requested context does not fit with every layer on the device, fit (patch "common : fit - keep every layer
on the device with part of the KV heads in host memory") weighs keeping every layer there with a fraction of each
layer's KV heads against moving layers to system memory, and takes the one its decode-speed model predicts faster.

The device is a local RPC server serving this machine's CPU (``LLAMA_HEADINFER_FORCE_SPLIT=1`` splits its layers,
which RPC devices otherwise do not); ``--fit-target`` leaves it ``room`` MiB; the model is an 8-layer GQA model (4 KV
heads) at a 128K context, whose 1 GiB KV cache does not fit. The rooms are not hard-coded: they are placed halfway
between the device totals llama-fit-params --fit-print reports for the configurations that must and must not fit,
so a few MiB of drift in the machine's free memory between two calls changes no decision. ``--fit-bandwidth`` fixes
the speed model's bandwidths, so the decision does not depend on this machine's. One test makes the same choice for a
real quantized GQA model (SmolLM2-135M-Instruct Q4_1, 3 KV heads per layer).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from testing_models import FORCE_SPLIT, SPECS, with_layers, write_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

N_CTX = 131072
MiB = 1024 * 1024
# GB/s of device memory, host-to-device copies, system memory and the CPU's attention over the KV
FAVOURS_SPLIT = "100,50,10,10"
SLOW_LINK = "100,1,20,20"


@pytest.fixture(scope="module")
def fit_model(tmp_path_factory) -> Path:
    spec = dataclasses.replace(with_layers(SPECS["llama-gqa"], 8), n_ctx_train=N_CTX)
    return write_model(spec, tmp_path_factory.mktemp("fit") / f"{spec.name}.gguf")


@pytest.fixture(scope="module")
def rpc_endpoint(rpc_build):
    from gpu_check import rpc_servers

    with rpc_servers(1, env=dict(os.environ, PYLLAMA_HEADINFER_BUILD_DIR=str(rpc_build))) as endpoints:
        yield endpoints[0]


def fit_params(rpc_build: Path, endpoint: str, model: Path, *args: str, split: bool = True,
               n_ctx: int = N_CTX) -> subprocess.CompletedProcess:
    """llama-fit-params on the RPC device, with the split forced on unless ``split`` is False (llama.cpp's default log
    level)."""
    env = dict(os.environ, **{FORCE_SPLIT: "1"}) if split else {k: v for k, v in os.environ.items() if k != FORCE_SPLIT}
    argv = [str(rpc_build / "bin" / "llama-fit-params"), "-m", str(model), "--rpc", endpoint, "-c", str(n_ctx),
            "-fa", "on", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)


def device_total_mib(rpc_build: Path, endpoint: str, model: Path, *args: str, n_ctx: int = N_CTX) -> int:
    """The RPC device's model + context + compute MiB for an explicit configuration (llama-fit-params --fit-print)."""
    run = fit_params(rpc_build, endpoint, model, "--fit-print", "on", "-ngl", "99", *args, n_ctx=n_ctx)
    assert run.returncode == 0, run.stderr[-2000:]
    row = next(line.split() for line in run.stdout.splitlines() if line.startswith("RPC0"))
    return sum(int(x) for x in row[1:4])


def free_mib() -> int:
    """The free memory the RPC device reports: its server serves this machine's CPU device."""
    from pyllama_headinfer.api.devices import device_free_bytes

    return device_free_bytes(["CPU"]) // MiB


def fit_with_room(rpc_build, endpoint, model, room_mib: int, *args: str, split: bool = True,
                  n_ctx: int = N_CTX) -> subprocess.CompletedProcess:
    return fit_params(rpc_build, endpoint, model, "-fitt", str(free_mib() - room_mib), *args, split=split, n_ctx=n_ctx)


def fitted_args(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 0, run.stdout[-1000:] + run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def totals(rpc_build, rpc_endpoint, fit_model, llama) -> dict:
    """Device MiB of the configurations the decisions are between (1 and 2 of 4 KV heads on the device)."""
    t = {name: device_total_mib(rpc_build, rpc_endpoint, fit_model, *args) for name, args in {
        "whole": (), "joined 1": ("-hgf", "0.25"), "joined 2": ("-hgf", "0.5"),
        "chunked 1": ("-hgf", "0.25", "--headinfer-attn", "chunked")}.items()}
    # the model's geometry gives room between them; without it the rooms below would decide nothing
    assert t["chunked 1"] + 64 < t["joined 1"] and t["joined 1"] + 64 < t["joined 2"] < t["whole"], t
    return t


def test_fit_keeps_every_layer_on_the_device_when_the_split_is_predicted_faster(rpc_build, rpc_endpoint, fit_model,
                                                                                totals):
    room = (totals["joined 1"] + totals["joined 2"]) // 2
    run = fit_with_room(rpc_build, rpc_endpoint, fit_model, room, "--fit-bandwidth", FAVOURS_SPLIT)
    args = fitted_args(run)
    assert re.fullmatch(rf"-c {N_CTX} -ngl -1 -hgf [0-9.]+", args), args
    frac = float(args.split()[-1])
    assert round(frac * 4) == 1, args  # one of 4 KV heads: the most that fits
    kv = re.search(r"chose every layer on the device, (\d+) of (\d+) MiB of KV in device memory .*joined attention",
                   run.stderr)
    assert kv and 4 * int(kv.group(1)) == int(kv.group(2)) == 1024, run.stderr[-2000:]
    assert re.search(r"rejected \d+ of 9 layers on the device", run.stderr)
    # scripts/fit_table.py decodes both answers on a GPU as it reads them from this log
    from fit_table import answers

    chose, rejected = answers(run.stderr)
    assert chose["verdict"] == "chose" and chose["config"] == {"ngl": 99, "frac": frac, "attn": "joined"}, chose
    assert rejected["verdict"] == "rejected" and rejected["config"]["frac"] == 1.0, rejected
    assert 0 < rejected["config"]["ngl"] < 9 and f"{rejected['config']['ngl']} of 9 layers" in rejected["what"]


def test_fit_splits_a_real_quantized_gqa_model(rpc_build, rpc_endpoint, smollm2):
    """The same choice for a real model: SmolLM2-135M-Instruct Q4_1 (30 layers of 3 KV heads of 64, quantized
    weights) at 16384 cells, 360 MiB of F16 KV. With room for one of its 3 KV heads per layer on the device and not
    two, fit keeps every layer there with one head (a third of the KV) when the split is predicted faster."""
    n_ctx = 16384
    one, two = (device_total_mib(rpc_build, rpc_endpoint, smollm2, "-hgf", frac, n_ctx=n_ctx) for frac in ("0.34", "0.67"))
    assert one + 64 < two, (one, two)
    run = fit_with_room(rpc_build, rpc_endpoint, smollm2, (one + two) // 2, "--fit-bandwidth", FAVOURS_SPLIT,
                        n_ctx=n_ctx)
    args = fitted_args(run)
    assert re.fullmatch(rf"-c {n_ctx} -ngl -1 -hgf [0-9.]+", args), args
    assert round(float(args.split()[-1]) * 3) == 1, args
    kv = re.search(r"chose every layer on the device, (\d+) of (\d+) MiB of KV in device memory", run.stderr)
    assert kv and 3 * int(kv.group(1)) == int(kv.group(2)) == 360, run.stderr[-2000:]


MOE_CTX = 32768


@pytest.fixture(scope="module", params=["one file", "split"])
def moe_model(request, tmp_path_factory) -> Path:
    """8 layers of 8 experts, 1 used per token: 192 of its 198 MiB of weights are experts; 256 MiB of KV at MOE_CTX.
    In one file, or split as gguf-split splits (7 files of at most 12 tensors: the first holds 16 MiB of experts)."""
    spec = dataclasses.replace(with_layers(SPECS["llama-gqa"], 8), name="llama-moe", n_ff=2048, n_ctx_train=MOE_CTX)
    return write_model(spec, tmp_path_factory.mktemp("fit") / f"{spec.name}.gguf", experts=(8, 1),
                       split_max_tensors=12 if request.param == "split" else 0)


def test_fit_counts_the_experts_a_token_reads(rpc_build, rpc_endpoint, moe_model):
    """A token reads 1 of 8 experts, so fit's speed model counts that share of the experts' weights it would move to
    system memory. Room for one of 4 KV heads per layer and not two; device 100, link 10, system memory 2 GB/s:
    upstream's answer moves the experts of four layers to system memory (96 MiB, of which a token reads 12), predicted
    faster than 192 MiB of host heads over the link. Counting all their bytes per token (as before) chose the split
    (21.8 against 49.7 tokens/s predicted); so did counting the experts of a split model's first file alone."""
    one, two = (device_total_mib(rpc_build, rpc_endpoint, moe_model, "-hgf", frac, n_ctx=MOE_CTX)
                for frac in ("0.25", "0.5"))
    assert one + 32 < two, (one, two)
    run = fit_with_room(rpc_build, rpc_endpoint, moe_model, (one + two) // 2, "--fit-bandwidth", "100,10,2,2",
                        n_ctx=MOE_CTX)
    args = fitted_args(run)
    assert re.fullmatch(rf'-c {MOE_CTX} -ngl 9 -ot "[^"]*exps=CPU[^"]*"', args), args
    chosen = re.search(r"chose 9 of 9 layers on the device: ([0-9.]+) tokens/s predicted", run.stderr)
    rejected = re.search(r"rejected every layer on the device, .*: ([0-9.]+) tokens/s predicted", run.stderr)
    assert chosen and rejected and float(chosen.group(1)) > 2 * float(rejected.group(1)), run.stderr[-2000:]


def test_fit_moves_layers_when_the_link_is_predicted_slower(rpc_build, rpc_endpoint, fit_model, totals):
    room = (totals["joined 1"] + totals["joined 2"]) // 2
    args = fitted_args(fit_with_room(rpc_build, rpc_endpoint, fit_model, room, "--fit-bandwidth", SLOW_LINK))
    m = re.fullmatch(rf"-c {N_CTX} -ngl (\d+)", args)
    assert m and 0 < int(m.group(1)) < 9, args


def test_fit_weighs_the_cpus_attention_over_the_kv_of_the_layers_it_would_move(rpc_build, rpc_endpoint, fit_model,
                                                                                totals):
    """The slow link's case, where upstream's answer wins with the moved layers' KV read at the memory's bandwidth
    (above), with the CPU's attention getting through that KV at 0.2 GB/s instead: the layers answer is now predicted
    at 0.5 tokens/s against the split's 1.2, and fit keeps every layer on the device."""
    room = (totals["joined 1"] + totals["joined 2"]) // 2
    run = fit_with_room(rpc_build, rpc_endpoint, fit_model, room, "--fit-bandwidth", "100,1,20,0.2")
    args = fitted_args(run)
    assert re.fullmatch(rf"-c {N_CTX} -ngl -1 -hgf [0-9.]+", args), args
    from fit_table import answers

    chose, rejected = answers(run.stderr)
    assert chose["config"]["ngl"] == 99 and rejected["config"]["ngl"] < 9, run.stderr[-2000:]
    assert chose["predicted"] > 1.5 * rejected["predicted"], run.stderr[-2000:]


def test_fit_times_the_cpus_attention_when_it_measures(rpc_build, rpc_endpoint, fit_model, totals):
    """Without --fit-bandwidth fit measures its rates and times the CPU's flash attention over the model's KV shape,
    and logs both before it compares the answers. It times the span the context's layers read: layers of n_ctx cells,
    as many as 1 GiB holds and the model has (here 128 MiB a layer: all 8), not a span a CPU's cache holds."""
    room = (totals["joined 1"] + totals["joined 2"]) // 2
    run = fit_with_room(rpc_build, rpc_endpoint, fit_model, room)
    assert re.search(r"measured bandwidths: device [0-9.]+ GB/s, host to device [0-9.]+ GB/s, system memory [0-9.]+ GB/s",
                     run.stderr), run.stderr[-2000:]
    timed = re.search(r"timed the CPU's attention at decode: ([0-9.]+) GB/s of KV \((\d+) layers of (\d+) cells\)",
                      run.stderr)
    assert timed and float(timed.group(1)) > 0, run.stderr[-2000:]
    assert (int(timed.group(2)), int(timed.group(3))) == (8, N_CTX), timed.group(0)
    from fit_table import answers

    assert [a["verdict"] for a in answers(run.stderr)] in (["chose", "rejected"], ["rejected", "chose"]), run.stderr


def test_fit_takes_chunked_attention_when_only_its_transient_fits(rpc_build, rpc_endpoint, fit_model, totals):
    room = (totals["chunked 1"] + totals["joined 1"]) // 2
    args = fitted_args(fit_with_room(rpc_build, rpc_endpoint, fit_model, room, "--fit-bandwidth", FAVOURS_SPLIT))
    assert re.fullmatch(rf"-c {N_CTX} -ngl -1 -hgf [0-9.]+ --headinfer-attn chunked", args), args


def test_an_explicit_fraction_is_kept_and_layers_fit_around_it(rpc_build, rpc_endpoint, fit_model, totals):
    room = (totals["joined 1"] + totals["joined 2"]) // 2
    args = fitted_args(fit_with_room(rpc_build, rpc_endpoint, fit_model, room, "--fit-bandwidth", FAVOURS_SPLIT,
                                     "-hgf", "0.5"))
    m = re.fullmatch(rf"-c {N_CTX} -ngl (\d+) -hgf 0.5", args)
    assert m and int(m.group(1)) < 9, args


def test_explicit_gpu_layers_stop_fit_as_before(rpc_build, rpc_endpoint, fit_model, totals):
    room = (totals["joined 1"] + totals["joined 2"]) // 2
    run = fit_with_room(rpc_build, rpc_endpoint, fit_model, room, "--fit-bandwidth", FAVOURS_SPLIT, "-ngl", "99")
    # llama-fit-params exits 1 printing no arguments, and its reason, which exit() cut off from common's asynchronous
    # log in 5 of 40 runs before the tool flushed it (patch "fit-params : flush the log before exiting ...")
    assert run.returncode == 1 and run.stdout.strip() == "", run.stdout
    assert "n_gpu_layers already set by user to 99" in run.stderr, run.stderr[-1000:]
    assert "chose" not in run.stderr and "rejected" not in run.stderr


def test_where_no_layer_splits_fit_answers_as_before(rpc_build, rpc_endpoint, fit_model, totals):
    """RPC devices do not split without the test hook (no pinned host buffer type): fit measures the split once, finds
    no host KV, and moves layers exactly as with the split forced on and a slow link -- upstream's answer."""
    room = (totals["joined 1"] + totals["joined 2"]) // 2
    plain = fit_with_room(rpc_build, rpc_endpoint, fit_model, room, "--fit-bandwidth", FAVOURS_SPLIT, split=False)
    args = fitted_args(plain)
    assert re.fullmatch(rf"-c {N_CTX} -ngl \d+", args), args
    assert "chose" not in plain.stderr and "rejected" not in plain.stderr and "bandwidths" not in plain.stderr
    layers = fitted_args(fit_with_room(rpc_build, rpc_endpoint, fit_model, room, "--fit-bandwidth", SLOW_LINK))
    assert args == layers


def test_a_bad_bandwidth_is_a_usage_error(rpc_build, rpc_endpoint, fit_model):
    for value in ("100,50,10", "100,0,10,10", "a,b,c,d", "100,50,10,-1"):
        run = fit_params(rpc_build, rpc_endpoint, fit_model, "--fit-bandwidth", value)
        assert run.returncode != 0 and "--fit-bandwidth" in run.stderr, (value, run.stderr[-500:])


ALLOCATE_CHILD = r"""
import json, sys
from pyllama_headinfer.llama import Context, Model, rpc_add_server
endpoint, path, n_ctx, frac, attn = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
with Model(path, n_gpu_layers=-1, devices=rpc_add_server(endpoint)) as model, \
        Context(model, n_ctx=n_ctx, n_batch=64, n_ubatch=64, flash_attn=True, headinfer_gpu_heads_frac=frac,
                headinfer_attn=attn) as ctx:
    ctx.decode(list(range(10, 60)))
    print(json.dumps(ctx.kv_residency()["buffers"]))
"""


def test_the_fitted_context_holds_on_the_device_the_kv_fit_projected(rpc_build, rpc_endpoint, fit_model, totals):
    """A context created with fit's answer allocates (and decodes), and its KV bytes on the RPC device are those fit
    logged as projected: the memory fit measured without allocating is what llama.cpp then allocates."""
    import json

    room = (totals["chunked 1"] + totals["joined 1"]) // 2
    run = fit_with_room(rpc_build, rpc_endpoint, fit_model, room, "--fit-bandwidth", FAVOURS_SPLIT)
    args = fitted_args(run).split()
    frac, attn = float(args[args.index("-hgf") + 1]), args[args.index("--headinfer-attn") + 1]
    projected = re.search(r"chose every layer on the device, (\d+) of (\d+) MiB of KV in device memory", run.stderr)
    assert projected, run.stderr[-2000:]

    env = dict(os.environ, PYLLAMA_HEADINFER_BUILD_DIR=str(rpc_build), PYTHONPATH=str(ROOT), **{FORCE_SPLIT: "1"})
    child = subprocess.run([sys.executable, "-c", ALLOCATE_CHILD, rpc_endpoint, str(fit_model), str(N_CTX), str(frac),
                            attn], capture_output=True, text=True, env=env, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    buffers = json.loads(child.stdout.strip().splitlines()[-1])
    on_device = sum(b["k"] + b["v"] for name, b in buffers.items() if name.startswith("RPC") and not b["headinfer_host"])
    in_host = sum(b["k"] + b["v"] for b in buffers.values() if b["headinfer_host"])
    assert on_device // MiB == int(projected.group(1)), buffers
    assert (on_device + in_host) // MiB == int(projected.group(2)), buffers
