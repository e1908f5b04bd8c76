#!/usr/bin/env python3
"""Bit-exactness of the HeadInfer split on a GPU, and where the KV bytes live.

    python -m pyllama_headinfer build            # CUDA when nvcc and a GPU are there
    python scripts/gpu_check.py [--ngl 99] [--models DIR] [--fracs 0.75,0.5,0.25] [--types f16,q8_0]

For each synthetic test model (written with the gguf package if --models is
not given; with them llama-8b-heads, Llama-3-8B's attention geometry in two
layers) and KV type, every scenario runs once unsplit (frac 1.0) and once
per fraction, all layers offloaded, and must give the same tokens and the same
logits, bit for bit:

- greedy: a 40-token prompt, then 64 greedy tokens (logits at every step);
- state: save the state, generate, restore it into a fresh context, generate again;
- shift: seq_rm + seq_add (RoPE K-shift), seq_div, then generate;
- streams: two KV streams (kv_unified = False), seq_cp across them, generate on the copy, then on both
  streams in one batch, then on the copy alone;
- full (only when asked, --scenarios full): a prompt of 1000 tokens and 24 greedy steps in a cache of 1024
  cells, filled to its last cell (with --attn chunked --attn-chunk 256 a split layer's last chunk ends the cache).

Each split run also checks the residency report: the device buffers hold exactly
g/n_head_kv of the unsplit bytes (each device of its own unsplit share) and the
host halves the rest.

Several devices: --devices CUDA0,CUDA1 [--split-mode layer|row] spreads the
layers as llama.cpp's -sm/--device do; --rpc 2 starts two local RPC servers
(a build with -DGGML_RPC=ON) and uses them, so the multi-device path runs on a
machine without GPUs (tests/test_multi_device.py).
Prints one line per check and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # testing_models: the test-model writers

import testing_models  # noqa: E402
from pyllama_headinfer.api.residency import kv_residency_totals  # noqa: E402
from pyllama_headinfer.llama import Context, Model, rpc_add_server  # noqa: E402
from pyllama_headinfer.params import HEADINFER_ATTN_TYPES  # noqa: E402
from pyllama_headinfer.runtime.log import logger as llama_logger  # noqa: E402

N_PROMPT = 40
N_GEN = 64


def greedy_steps(ctx: Context, n: int, seq_id: int = 0, tokens=None, logits=None) -> tuple[list, list]:
    """n greedy steps from the logits the last decode left; returns (tokens, logits)."""
    tokens = [] if tokens is None else tokens
    logits = [] if logits is None else logits
    for _ in range(n):
        row = ctx.logits(-1)
        logits.append(row)
        tok = int(np.argmax(row))
        tokens.append(tok)
        ctx.decode([tok], seq_id=seq_id)
    return tokens, logits


def scenario_greedy(ctx: Context, prompt: list, kv_bytes: list) -> tuple[list, list]:
    ctx.decode(prompt)
    kv_bytes.append(ctx.save_state(logits=False))  # the KV bytes the prompt stored, in the logical (unsplit) layout
    tokens, logits = greedy_steps(ctx, N_GEN)
    kv_bytes.append(ctx.save_state(logits=False))
    return tokens, logits


def scenario_state(ctx: Context, prompt: list, make_ctx) -> tuple[list, list]:
    ctx.decode(prompt)
    tokens, logits = greedy_steps(ctx, 8)
    state = ctx.save_state()
    greedy_steps(ctx, 8, tokens=tokens, logits=logits)
    with make_ctx() as fresh:
        fresh.load_state(state)  # the KV cache and the logits of the last decode (api/state.py)
        greedy_steps(fresh, 16, tokens=tokens, logits=logits)
    return tokens, logits


def scenario_shift(ctx: Context, prompt: list) -> tuple[list, list]:
    ctx.decode(prompt)
    ctx.seq_rm(0, 5, 15)
    ctx.seq_add(0, 15, -1, -10)
    ctx.decode([prompt[-1]])
    tokens, logits = greedy_steps(ctx, 24)
    ctx.seq_div(0, 0, -1, 2)
    ctx.decode([tokens[-1]])
    return greedy_steps(ctx, 16, tokens=tokens, logits=logits)


def scenario_streams(ctx: Context, prompt: list) -> tuple[list, list]:
    ctx.decode(prompt, seq_id=0)
    ctx.seq_cp(0, 1)
    ctx.decode([prompt[-1]], seq_id=1)
    tokens, logits = greedy_steps(ctx, 24, seq_id=1)
    # both streams in each ubatch: a split layer's host heads are read over both, and the streams are far from full
    # (STREAMS_N_CTX), so an offload device is sent the used cells of each stream, not the cells between them
    following = {0: tokens[0], 1: int(np.argmax(ctx.logits(-1)))}
    for _ in range(8):
        rows = ctx.decode_batch({seq_id: [tok] for seq_id, tok in following.items()})
        for seq_id, row in rows.items():
            logits.append(ctx.logits(row))
            following[seq_id] = int(np.argmax(logits[-1]))
            tokens.append(following[seq_id])
    ctx.seq_keep(1)
    ctx.decode([following[1]], seq_id=1)
    return greedy_steps(ctx, 8, seq_id=1, tokens=tokens, logits=logits)


def scenario_full(ctx: Context, prompt: list) -> tuple[list, list]:
    ctx.decode((prompt * (FULL_N_CTX // len(prompt) + 1))[:FULL_N_CTX - FULL_N_STEPS])
    tokens, logits = greedy_steps(ctx, FULL_N_STEPS)
    logits.append(ctx.logits(-1))  # the logits of the step that filled the last cell (greedy_steps reads each step's
    return tokens, logits          # logits before the next step, so it never reads the last one's)


DEFAULT_SCENARIOS = ("greedy", "state", "shift", "streams")
SCENARIOS = DEFAULT_SCENARIOS + ("full",)
STREAMS_N_CTX = 1024  # two streams of 512 cells: the scenario uses fewer than 256 of each (the attention's n_kv)
FULL_N_CTX, FULL_N_STEPS = 1024, 24  # the prompt fills all cells but the steps'


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def capture_messages():
    """The messages llama.cpp logs (through the pyllama_headinfer.llama logger) inside the block."""
    handler, level = _Messages(), llama_logger.level
    llama_logger.addHandler(handler)
    llama_logger.setLevel(logging.DEBUG)
    try:
        yield handler.messages
    finally:
        llama_logger.removeHandler(handler)
        llama_logger.setLevel(level)


def pipeline_problems(report: dict, base: dict) -> list[str]:
    """Issue 13.2: pipeline parallelism (several devices, -sm layer, full offload) keeps every uploaded host half;
    llama.cpp must turn it off, saying so, whenever a layer is split."""
    if not any("pipeline parallelism enabled" in m for m in base["log"]):
        return []  # not enabled for these devices even without the split: nothing to turn off
    split = any(x["n_head_resident"] < x["n_head_kv"] for x in report["layers"])
    if not split:
        return []
    problems = []
    if any("pipeline parallelism enabled" in m for m in report["log"]):
        problems.append("pipeline parallelism enabled with split layers")
    if not any("pipeline parallelism disabled" in m for m in report["log"]):
        problems.append("no log line says pipeline parallelism was disabled")
    return problems


# how the split layers are attended (--attn, --attn-chunk): ContextParams' names
HEADINFER = {"headinfer_attn": "joined"}


def add_attn_arguments(ap: argparse.ArgumentParser) -> None:
    """--attn and --attn-chunk (ContextParams.headinfer_attn / .headinfer_attn_chunk); also used by
    decode_host_time.py, decode_timeline.py, graph_splits.py and plan_check.py."""
    ap.add_argument("--attn", choices=tuple(HEADINFER_ATTN_TYPES), default="joined",
                    help="how split layers attend to their two halves (headinfer_attn; default joined)")
    ap.add_argument("--attn-chunk", type=int, default=0,
                    help="KV cells per chunk with --attn chunked (headinfer_attn_chunk; default 0: llama.cpp's)")


@contextlib.contextmanager
def filled_context(model: Model, depth: int, n_steps: int, args: argparse.Namespace, frac: float, **params):
    """A context of depth + n_steps + 256 cells (n_ubatch 2048, flash attention, KV type args.type, attention
    args.attn / args.attn_chunk, headinfer_gpu_heads_frac frac, any other ContextParams in params) filled with depth
    tokens, the fill computed: the speed scripts' (decode_host_time.py, decode_timeline.py) starting point."""
    with Context(model, n_ctx=depth + n_steps + 256, n_batch=2048, n_ubatch=2048, flash_attn=True,
                 type_k=args.type, type_v=args.type, headinfer_gpu_heads_frac=frac, headinfer_attn=args.attn,
                 headinfer_attn_chunk=args.attn_chunk, **params) as ctx:
        ctx.decode([1 + i % (model.n_vocab - 1) for i in range(depth)], logits="none")
        ctx.synchronize()  # llama_decode returns once the fill's last ubatch is queued, not computed
        yield ctx


def headinfer_params(args: argparse.Namespace) -> dict:
    return {"headinfer_attn": args.attn, "headinfer_attn_chunk": args.attn_chunk}


def run(model: Model, scenario: str, frac: float, kv_type: str, prompt: list) -> tuple[list, list, dict, list]:
    def make_ctx() -> Context:
        n_ctx = {"streams": STREAMS_N_CTX, "full": FULL_N_CTX}.get(scenario, 256)
        return Context(model, n_ctx=n_ctx, n_batch=256, n_ubatch=256,
                       flash_attn=True, type_k=kv_type, type_v=kv_type, n_seq_max=2 if scenario == "streams" else 1,
                       kv_unified=False, headinfer_gpu_heads_frac=frac, **HEADINFER)

    kv_bytes: list = []
    with capture_messages() as log, make_ctx() as ctx:
        report = ctx.kv_residency()
        report["log"] = list(log)  # llama.cpp's log of the context creation
        if scenario == "greedy":
            tokens, logits = scenario_greedy(ctx, prompt, kv_bytes)
        elif scenario == "state":
            tokens, logits = scenario_state(ctx, prompt, make_ctx)
        elif scenario == "shift":
            tokens, logits = scenario_shift(ctx, prompt)
        elif scenario == "streams":
            tokens, logits = scenario_streams(ctx, prompt)
        else:
            tokens, logits = scenario_full(ctx, prompt)
    return tokens, logits, report, kv_bytes


def residency_problems(report: dict, base: dict) -> list[str]:
    """Device bytes must be exactly n_head_resident/n_head_kv of the unsplit bytes, host the rest."""
    problems = []
    layers = report["layers"]
    split = [x for x in layers if x["n_head_resident"] < x["n_head_kv"]]
    if not split:
        problems.append("no layer was split")
    dev = {k: v for k, v in report["buffers"].items() if not v["headinfer_host"]}
    base_total = sum(kv_residency_totals(base))
    dev_total, host_total = kv_residency_totals(report)
    if dev_total + host_total != base_total:
        problems.append(f"device + host = {dev_total + host_total} B != unsplit {base_total} B")
    # every layer of the test models keeps the same share g/n of its heads: the device holds exactly that share
    shares = {(x["n_head_resident"], x["n_head_kv"]) for x in layers}
    if len(shares) == 1:
        (g, n), = shares
        if dev_total * n != base_total * g:
            problems.append(f"device KV {dev_total} B is not {g}/{n} of the unsplit {base_total} B")
        # with several devices, each holds g/n of its own unsplit share
        for name, b in dev.items():
            unsplit = base["buffers"].get(name)
            if unsplit is None or (b["k"] + b["v"]) * n != (unsplit["k"] + unsplit["v"]) * g:
                problems.append(f"{name}: KV {b['k'] + b['v']} B is not {g}/{n} of its unsplit share "
                                f"{None if unsplit is None else unsplit['k'] + unsplit['v']} B")
    return problems


def _die_with_parent() -> None:
    """In the child: get SIGKILL when this script dies, even if it is killed or aborts (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the finally block below still stops the servers on a normal exit


@contextlib.contextmanager
def rpc_servers(n: int, timeout: float = 30.0, env: dict | None = None):
    """n local RPC servers (this build's CPU device each, own processes; ``env``: their environment, default this
    process's): yields their endpoints."""
    procs, endpoints = [], []
    root = Path(__file__).resolve().parents[1]
    # all ports chosen while every probe socket is still bound, so no two servers get the same one
    with contextlib.ExitStack() as probes:
        for _ in range(n):
            sock = probes.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            endpoints.append(f"127.0.0.1:{sock.getsockname()[1]}")
    try:
        for endpoint in endpoints:
            code = f"import sys; sys.path.insert(0, {str(root)!r}); from pyllama_headinfer.llama import rpc_serve; " \
                   f"rpc_serve({endpoint!r})"
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, preexec_fn=_die_with_parent, env=env))
        for endpoint, proc in zip(endpoints, procs):
            host, port = endpoint.rsplit(":", 1)
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"RPC server {endpoint} exited: {proc.stderr.read().decode()[-500:]}")
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"RPC server {endpoint} did not start within {timeout:g} s") from None
                    time.sleep(0.1)
        yield endpoints
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ngl", type=int, default=99, help="layers to offload (default: 99 = all)")
    ap.add_argument("--models", type=Path, help="directory with the test models (default: write them to a temp dir)")
    ap.add_argument("--fracs", default="0.75,0.5,0.25")
    ap.add_argument("--types", default="f16,q8_0")
    ap.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                    help=f"comma-separated, of {', '.join(SCENARIOS)} (default: %(default)s)")
    ap.add_argument("--no-8b-heads", dest="with_8b_heads", action="store_false",
                    help="skip the model with Llama-3-8B's attention geometry (8 KV heads of 128, 2 layers)")
    ap.add_argument("--devices", default=None,
                    help="comma-separated devices to spread the layers over, e.g. CUDA0,CUDA1 (default: llama.cpp's)")
    ap.add_argument("--split-mode", default="layer", choices=("layer", "row", "none"),
                    help="how llama.cpp spreads the layers over several devices (default: layer)")
    ap.add_argument("--rpc", type=int, default=0, metavar="N",
                    help="start N local RPC servers (a build with -DGGML_RPC=ON) and use their devices: "
                         "several offload devices on a machine without GPUs")
    add_attn_arguments(ap)
    ap.add_argument("--no-cuda-fusion", action="store_true",
                    help="set GGML_CUDA_DISABLE_FUSION=1: CUDA fuses ROPE->VIEW->SET_ROWS only where the whole K row "
                         "is stored, i.e. in the unsplit graph, and its fused result differs from the unfused one "
                         "(docs/GPU.md); without fusion both graphs run the same kernels")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.scenarios.split(",")) - set(SCENARIOS))
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(unknown)}: choose from {', '.join(SCENARIOS)}")
    HEADINFER.update(headinfer_params(args))
    if args.no_cuda_fusion:
        os.environ["GGML_CUDA_DISABLE_FUSION"] = "1"  # read by ggml-cuda at its first graph, after this
    print(f"CUDA kernel fusion: {'off' if os.environ.get('GGML_CUDA_DISABLE_FUSION', '0') not in ('', '0') else 'on'}")

    models_dir = args.models or Path(tempfile.mkdtemp(prefix="headinfer-models-"))
    if args.models is None:
        paths = testing_models.write_test_models(models_dir)
        if args.with_8b_heads:
            paths.update(testing_models.ensure_gpu_models(models_dir, ["llama-8b-heads"]))
    else:
        paths = {p.stem: p for p in sorted(models_dir.glob("*.gguf"))}
    fracs = [float(f) for f in args.fracs.split(",")]
    if args.rpc and args.devices:
        ap.error("--rpc uses the RPC servers' devices: give --rpc or --devices, not both")
    with (rpc_servers(args.rpc) if args.rpc else contextlib.nullcontext([])) as endpoints:
        devices = [d for e in endpoints for d in rpc_add_server(e)] or \
            (args.devices.split(",") if args.devices else None)
        if devices:
            print(f"devices: {', '.join(devices)} (split mode {args.split_mode})")
        failures = check_models(paths, fracs, args, devices)
    print(f"{failures} check(s) failed" if failures else "all checks passed")
    return 1 if failures else 0


def check_models(paths: dict, fracs: list, args, devices) -> int:
    """Every model x type x scenario x frac against frac 1.0; prints a line per check, returns the failures."""
    failures = 0
    for name, path in paths.items():
        with Model(path, n_gpu_layers=args.ngl, devices=devices, split_mode=args.split_mode) as model:
            prompt = model.tokenize(testing_models.CORPUS)[:N_PROMPT]
            for kv_type in args.types.split(","):
                for scenario in args.scenarios.split(","):
                    base_tokens, base_logits, base_report, base_kv = run(model, scenario, 1.0, kv_type, prompt)
                    for frac in fracs:
                        tokens, logits, report, kv = run(model, scenario, frac, kv_type, prompt)
                        same_logits = len(logits) == len(base_logits) and all(
                            np.array_equal(a, b) for a, b in zip(logits, base_logits))
                        problems = residency_problems(report, base_report) + pipeline_problems(report, base_report)
                        if tokens != base_tokens:
                            problems.append("tokens differ")
                        if len(logits) != len(base_logits):
                            problems.append(f"{len(logits)} steps, unsplit {len(base_logits)}")
                        elif not same_logits:
                            diff = max(float(np.max(np.abs(a - b))) for a, b in zip(logits, base_logits))
                            first = next(i for i, (a, b) in enumerate(zip(logits, base_logits))
                                         if not np.array_equal(a, b))
                            problems.append(f"logits differ from step {first} (max |diff| {diff:.3g})")
                        # greedy: were the stored KV bytes already different (a store), or only the logits (compute)?
                        for what, a, b in zip(("after the prompt", "at the end"), kv, base_kv):
                            if a != b:
                                problems.append(f"KV bytes differ {what}")
                        where = ", ".join(f"{k}: {(v['k'] + v['v']) / 2**20:.2f} MiB"
                                          for k, v in report["buffers"].items())
                        if any("pipeline parallelism" in m for m in base_report["log"] + report["log"]):
                            where += "; pipeline parallelism: " + ("on" if any(
                                "pipeline parallelism enabled" in m for m in report["log"]) else "off")
                        status = "ok  " if not problems else "FAIL"
                        failures += bool(problems)
                        print(f"{status} {name:12s} {kv_type:5s} {scenario:8s} frac={frac:.2f} "
                              f"steps={len(logits):3d} [{where}] {'; '.join(problems)}", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
