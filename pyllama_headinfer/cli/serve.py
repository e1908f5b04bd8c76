"""``python -m pyllama_headinfer serve``: the patched ``llama-server`` of the
current build, under the HeadInfer split.

    python -m pyllama_headinfer serve --model M.gguf [--frac F | --vram-budget SIZE]
        [--host 127.0.0.1] [--port 8080] [-- extra llama-server arguments]

Starts ``llama-server`` (built by ``build --tools``, found through the build's
manifest) with flash attention on, ``-hgf F`` and ``-t N``, N the CPUs this
process may run on (:func:`~pyllama_headinfer.params.default_n_threads`;
llama-server's own default is the machine's physical cores, affinity or not),
unless the extra arguments give ``-t``/``--threads`` or ``LLAMA_ARG_THREADS``
is set; with ``--vram-budget`` the
fraction comes from the planner, fed with the server's context size, slots,
cache types and attention mode taken from the extra arguments (``-c``, ``-np``,
``-ctk``, ``-ctv``, ``-b``, ``-ub``, ``-ngl``, ``-kvu``, ``--headinfer-attn``,
``--headinfer-attn-chunk``). Waits until the server answers
``/health``, then prints its URL and the split decision llama.cpp logged
(never guessed), and stays in the foreground: SIGINT/SIGTERM are forwarded,
and the exit status is the server's. A port in use, a build without the
server or a server that dies while starting is a one-line error (exit 1); bad
arguments, a missing model exit 2 (see cli/main.py). Once the server runs,
the exit status is the server's.

The server binds to 127.0.0.1 unless ``--host`` says otherwise. It runs in
a session of its own (a Ctrl-C reaches it once, forwarded), and on Linux its
life is tied to ours: if ``serve`` is killed outright (``kill -9``), the
kernel sends the server SIGTERM (``prctl(PR_SET_PDEATHSIG)``), so it does not
stay behind holding the port.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from pyllama_headinfer.errors import PlanError, ServeError, UsageError
from pyllama_headinfer.cli.options import THREADS_DEFAULT_HELP
from pyllama_headinfer.params import (AUTO_VRAM_BUDGET, ContextParams, check_headinfer_frac, default_n_threads,
                                      format_bytes)
from pyllama_headinfer.runtime.manifest import BUILD_DIR_ENV, Manifest, announce, find_manifest
from pyllama_headinfer.vram.model import read_model_info
from pyllama_headinfer.vram.speed import rank_options

logger = logging.getLogger(__name__)

SERVER = "llama-server"
STARTUP_TIMEOUT_S = 600.0  # loading a large model from a slow disk takes minutes

# llama-server options that the planner needs, with their aliases (common/arg.cpp at the pin)
_PASSTHROUGH_VALUES = {
    "ctx": ("-c", "--ctx-size"),
    "parallel": ("-np", "--parallel"),
    "type_k": ("-ctk", "--cache-type-k"),
    "type_v": ("-ctv", "--cache-type-v"),
    "batch": ("-b", "--batch-size"),
    "ubatch": ("-ub", "--ubatch-size"),
    "ngl": ("-ngl", "--gpu-layers", "--n-gpu-layers"),
    "attn": ("--headinfer-attn",),
    "attn_chunk": ("--headinfer-attn-chunk",),
}
_OWNED = ("-m", "--model", "--host", "--port", "-hgf", "--headinfer-gpu-heads-frac")
_THREADS = ("-t", "--threads")  # serve passes -t unless one is given, or LLAMA_ARG_THREADS (common/arg.cpp) is set


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", required=True, help="GGUF model file")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--frac", type=float, default=None,
                     help="fraction of each layer's KV heads kept on the GPU (default 1.0: no split)")
    how.add_argument("--vram-budget", default=None,
                     help="GPU memory budget, e.g. 24GiB: the planner chooses the fraction for the server's "
                          "context size, slots and cache types; 'auto': llama-server's own --fit chooses it for "
                          "the GPU's free memory")
    parser.add_argument("--allow-quantized-kv", action="store_true",
                        help="with --vram-budget: also consider q8_0/q4_0 caches (faster, not exact); default: "
                             "the fastest exact option")
    parser.add_argument("--margin", default="0",
                        help="with --vram-budget: memory to keep free besides llama.cpp's buffers (e.g. 600MiB)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080, llama-server's)")
    parser.add_argument("server_args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                        help="more llama-server arguments, after -- (e.g. -c N, the context size; -c 0 = "
                             "the model's training context, llama-server's default); -t (CPU threads) defaults to "
                             f"{THREADS_DEFAULT_HELP.format(n=default_n_threads())} (llama-server's own "
                             "default: the machine's physical cores)")


@dataclass
class ServerCommand:
    argv: List[str]
    url: str
    frac: float
    notes: List[str] = field(default_factory=list)
    backend: Optional[str] = None  # the build's ("cpu", "cuda"; manifest.json), None when not known


def run(args: argparse.Namespace) -> int:
    extra = list(args.server_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    command = server_command(args.model, frac=args.frac, vram_budget=args.vram_budget, margin=args.margin,
                             host=args.host, port=args.port, extra=extra, allow_quantized_kv=args.allow_quantized_kv)
    for note in command.notes:
        logger.info("%s", note)
    return serve(command)


# --------------------------------------------------------------------------
# the command line of the server


def find_server(manifest: Optional[Manifest] = None) -> Path:
    """The llama-server of the build in use (``build --tools`` makes it)."""
    manifest = manifest or find_manifest()
    announce(manifest)
    bdir = manifest.build_dir
    path = (manifest.data.get("executables") or {}).get(SERVER)
    if not path or not Path(path).is_file():
        hint = f"--build-dir {bdir} " if os.environ.get(BUILD_DIR_ENV) else ""
        raise ServeError(f"the build in {bdir} has no {SERVER}: run `python -m pyllama_headinfer build {hint}--tools`")
    return Path(path)


def _option_value(args: Sequence[str], names: Sequence[str]) -> Optional[str]:
    """The value of the last occurrence of an option (``-c 4096`` or ``--ctx-size=4096``)."""
    value = None
    for i, word in enumerate(args):
        for name in names:
            if word == name and i + 1 < len(args):
                value = args[i + 1]
            elif name.startswith("--") and word.startswith(name + "="):
                value = word.split("=", 1)[1]
    return value


def _int_option(args: Sequence[str], key: str, default: int) -> int:
    value = _option_value(args, _PASSTHROUGH_VALUES[key])
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{'/'.join(_PASSTHROUGH_VALUES[key])} needs an integer, got {value!r}") from None


def _server_slots(extra: Sequence[str]) -> Tuple[int, bool]:
    """(slots, one unified KV cache) of llama-server's arguments ``-np``/``-kvu``; without ``-np``
    llama-server's "auto": 4 slots in one unified cache."""
    n_parallel = _int_option(extra, "parallel", -1)
    if n_parallel < 0:
        return 4, True
    return n_parallel, any(w in ("-kvu", "--kv-unified") for w in extra)


def server_context_fields(extra: Sequence[str], n_ctx_train: int) -> dict:
    """The :class:`ContextParams` fields of a llama-server started with the arguments ``extra``, as ``plan`` reads
    them, with llama-server's defaults: the context (``-c``; 0 or absent: ``n_ctx_train``), the slots and their KV
    layout (``-np``, ``-kvu``), the batch sizes (``-b``, ``-ub``) and the attention mode. Not the KV types
    (:func:`server_kv_types`), which ``--vram-budget`` may choose. UsageError for a non-integer value."""
    n_parallel, unified = _server_slots(extra)
    batch = _int_option(extra, "batch", 2048)
    return dict(n_ctx=_int_option(extra, "ctx", 0) or n_ctx_train, n_seq_max=n_parallel, kv_unified=unified,
                n_batch=batch, n_ubatch=_int_option(extra, "ubatch", min(batch, 512)),
                headinfer_attn=_option_value(extra, _PASSTHROUGH_VALUES["attn"]) or "joined",
                headinfer_attn_chunk=_int_option(extra, "attn_chunk", 0))


def server_kv_types(extra: Sequence[str]) -> Tuple[Optional[str], Optional[str]]:
    """``(-ctk, -ctv)`` of llama-server's arguments ``extra``, None where not given."""
    return _option_value(extra, _PASSTHROUGH_VALUES["type_k"]), _option_value(extra, _PASSTHROUGH_VALUES["type_v"])


def server_command(model, *, frac: Optional[float], vram_budget, margin, host: str, port: int,
                   extra: Sequence[str], server: Optional[Path] = None, backend: Optional[str] = None,
                   allow_quantized_kv: bool = False) -> ServerCommand:
    """The llama-server command line for these arguments (no process started). ``server``
    (and its build's ``backend``) default to the build in use's."""
    model = Path(model)
    if not model.is_file():
        raise UsageError(f"model not found: {model}")
    if not 0 < port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {port}")
    owned = [w for w in extra if w.split("=", 1)[0] in _OWNED]
    if owned:
        raise UsageError(f"give {', '.join(sorted(set(owned)))} as serve's own options, not after --")
    notes = []
    extra = list(extra)
    fit_decides = vram_budget == AUTO_VRAM_BUDGET
    if fit_decides:  # llama-server fits itself to the GPU's free memory at start (--fit, on by default)
        notes.append("--vram-budget auto: llama-server's --fit chooses the fraction for the GPU's free memory when the "
                     "context does not fit whole, where it predicts that faster than layers on the CPU; its log says "
                     "what it chose (docs/UPSTREAM.md, PR 8)")
        vram_budget = None
    if vram_budget is not None:
        frac, types, note = _frac_for_server(model, vram_budget, margin, extra, allow_quantized_kv)
        notes.append(note)
        extra += types
    frac = 1.0 if frac is None else frac
    try:
        frac = check_headinfer_frac(frac)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    n_parallel, unified = _server_slots(extra)
    if frac < 1.0 and n_parallel > 1 and not unified:
        notes.append(f"-np {n_parallel} without -kvu: one KV stream per slot; each split layer's upload then "
                     "carries as many cells of every slot as the longest slot uses (up to -np times the cells in "
                     "use when the slots' lengths differ); -kvu (one cache for all slots, llama-server's default "
                     "without -np) uploads only the cells in use (docs/SERVING.md)")
    if server is None:
        manifest = find_manifest()
        server, backend = find_server(manifest), manifest.data.get("backend")
    given = any(w.split("=", 1)[0] in _THREADS for w in extra) or "LLAMA_ARG_THREADS" in os.environ
    threads = [] if given else ["-t", str(default_n_threads())]
    hgf = [] if fit_decides else ["-hgf", f"{frac:.9g}"]
    argv = [str(server), "-m", str(model), "--host", host, "--port", str(port), "-fa", "on", *hgf, *threads, *extra]
    shown = f"[{host}]" if ":" in host else host
    return ServerCommand(argv=argv, url=f"http://{shown}:{port}", frac=frac, notes=notes, backend=backend)


def _frac_for_server(model: Path, vram_budget, margin, extra: Sequence[str], allow_quantized_kv: bool):
    """(frac, extra -ctk/-ctv arguments, a note) for the server's context (from the extra arguments).

    Without -ctk/-ctv the KV type is chosen too: the fastest exact option that fits (f16 and a
    fraction), or with ``allow_quantized_kv`` the fastest of all (e.g. q8_0 whole)."""
    info = read_model_info(model)
    margin = 0 if str(margin).strip() in ("", "0") else margin
    fields = server_context_fields(extra, info.n_ctx_train)
    n_ctx, n_parallel = fields["n_ctx"], fields["n_seq_max"]
    type_k, type_v = server_kv_types(extra)
    given = type_k is not None or type_v is not None
    types = [(type_k or "f16")] if given else ["f16", "q8_0", "q4_0"]
    try:
        # the attention mode changes what a split layer needs on the device (in chunks: one chunk, not the layer)
        params = ContextParams(**fields, headinfer_vram_budget=vram_budget)
        ranking = rank_options(info, params, types=types, n_gpu_layers=_int_option(extra, "ngl", -1), margin=margin)
    except (PlanError, ValueError) as exc:
        raise UsageError(f"--vram-budget: {exc}") from None
    if given and type_v is not None and type_v != (type_k or "f16"):
        raise UsageError("--vram-budget plans one KV type for K and V: give the same -ctk and -ctv")
    pick = ranking.choose(allow_quantized_kv or given)  # given types: the ranking holds only them
    if pick is None:
        raise UsageError(f"--vram-budget {vram_budget}: nothing fits at n_ctx {n_ctx} with {n_parallel} "
                              "slot(s); a smaller context (-c), fewer slots (-np) or a larger budget would")
    note = (f"--vram-budget {format_bytes(ranking.budget)}: K/V {pick.type_k}, g = {pick.g} of {pick.n_head_kv} KV "
            f"heads on the device (frac {pick.frac:.6g}) for n_ctx {n_ctx}, {n_parallel} slot(s); estimated "
            f"device total {format_bytes(pick.device_bytes)}, {format_bytes(pick.host_kv)} of KV in host memory, "
            f"{pick.predicted_decode_tok_s:.1f} tok/s predicted per sequence at a full context")
    other = ranking.faster_alternative(pick)
    if other:
        note += f"; {other}"
    types_args = [] if given else ["-ctk", pick.type_k, "-ctv", pick.type_v]
    return pick.frac, types_args, note


# --------------------------------------------------------------------------
# running it


def port_in_use(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


class _LogPump(threading.Thread):
    """Copies the server's output to our stderr, keeping the tail and the HeadInfer lines."""

    def __init__(self, stream, echo) -> None:
        super().__init__(daemon=True)
        self.stream, self.echo = stream, echo
        self.tail: deque = deque(maxlen=20)
        self.headinfer: List[str] = []

    def run(self) -> None:
        for line in iter(self.stream.readline, ""):
            text = line.rstrip("\n")
            self.tail.append(text)
            if "headinfer:" in text.lower():  # llama.cpp's lines about the split ("... headinfer: ...")
                self.headinfer.append(text)
            if self.echo is not None:
                self.echo.write(line)
                self.echo.flush()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _dies_with_us():
    """A ``preexec_fn`` that makes Linux send the child SIGTERM when this process dies
    (``prctl(PR_SET_PDEATHSIG)``), or None where there is no such thing.

    The kernel sends it when the *thread* that started the child ends: start the
    server from a thread that outlives it (``serve`` uses the main thread)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGTERM), ctypes.c_ulong(0),
              ctypes.c_ulong(0), ctypes.c_ulong(0))
        if os.getppid() != parent:  # we died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def start_server(command: ServerCommand, *, echo=sys.stderr, timeout: float = STARTUP_TIMEOUT_S,
                 env=None) -> tuple:
    """Start the server and wait until it is ready: (process, log pump). Raises ServeError.

    The server gets a session of its own and, on Linux, dies with this process (see the
    module docstring)."""
    host = command.argv[command.argv.index("--host") + 1]
    port = int(command.argv[command.argv.index("--port") + 1])
    if port_in_use(host, port):
        raise ServeError(f"port {port} on {host} is in use: choose another with --port")
    try:
        proc = subprocess.Popen(command.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                encoding="utf-8", errors="replace", bufsize=1, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, preexec_fn=_dies_with_us())
    except OSError as exc:
        raise ServeError(f"cannot run {command.argv[0]}: {exc}") from None
    pump = _LogPump(proc.stdout, echo)
    pump.start()
    deadline = time.monotonic() + timeout
    while not _healthy(command.url):
        if proc.poll() is not None:
            pump.join(timeout=5)
            last = "; ".join(line for line in list(pump.tail)[-3:] if line.strip()) or "no output"
            raise ServeError(f"{SERVER} exited with status {proc.returncode} while starting: {last}")
        if time.monotonic() > deadline:
            stop_server(proc)
            raise ServeError(f"{SERVER} did not answer {command.url}/health within {timeout:.0f} s")
        time.sleep(0.2)
    return proc, pump


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


# where the KV cache lives without the split, by the build's backend
_WHOLE_KV = {
    "cpu": "the whole KV cache in CPU memory (a CPU build: no device)",
    "cuda": "the whole KV cache in the layers' own buffers (on the GPU for the layers offloaded with -ngl)",
}


def split_decision(pump: _LogPump, frac: float, backend: Optional[str] = None) -> str:
    """What llama.cpp logged about the split (the server's own lines), for the user;
    at frac 1.0 where the KV cache is, as far as the build's ``backend`` tells."""
    if frac >= 1.0:
        where = _WHOLE_KV.get(backend, "the whole KV cache in the layers' own buffers")
        return f"HeadInfer split off (frac 1.0): {where}"
    if not pump.headinfer:
        return f"frac {frac:g} requested; llama-server logged nothing about the split"
    return "; ".join(line.split("headinfer:", 1)[-1].strip() for line in pump.headinfer)


def serve(command: ServerCommand) -> int:
    """Run the server in the foreground until it exits or we are stopped."""
    proc, pump = start_server(command)
    print(f"{SERVER} ready at {command.url} (OpenAI API: {command.url}/v1)", file=sys.stderr)
    print(f"split: {split_decision(pump, command.frac, command.backend)}", file=sys.stderr)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()  # SIGINT/SIGTERM go to forward(), not KeyboardInterrupt, while we wait
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        pump.join(timeout=5)
    return rc if rc >= 0 else 128 - rc
