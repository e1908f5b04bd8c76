"""The compute devices ggml knows (GPUs, the CPU, RPC servers), and RPC.

A model's layers go to the devices named in ``Model(devices=[...])`` (all
non-CPU devices by default, as in llama.cpp). RPC servers -- ggml's way of
using another machine's or another process's device -- are added with
:func:`rpc_add_server` and then appear in :func:`list_devices` as ``RPC<n>``
(llama.cpp's ``--rpc``). :func:`rpc_serve` turns this process into such a
server for its CPU; with two of them one machine without a GPU has two
offload devices, which is how the tests split a model's layers over two
devices (``-sm layer``) on the CPU.

RPC needs a build with ``-DGGML_RPC=ON``; without it these functions raise
:class:`HeadInferError` (the functions are looked up in ggml's backend
registry, so the bindings work with either build).
"""

from __future__ import annotations

import socket
from typing import NamedTuple, Sequence

from pyllama_headinfer.runtime import bindings
from pyllama_headinfer.errors import HeadInferError
from pyllama_headinfer.runtime.log import checked_call


class DeviceInfo(NamedTuple):
    name: str  # e.g. "CUDA0", "CPU", "RPC0[127.0.0.1:50052]"
    description: str
    type: str  # "cpu", "gpu", "igpu", "accel", ...


_TYPES = {"GGML_BACKEND_DEVICE_TYPE_CPU": "cpu", "GGML_BACKEND_DEVICE_TYPE_GPU": "gpu"}


def _type_name(ffi, lib, dev) -> str:
    value = int(lib.ggml_backend_dev_type(dev))
    for cname, short in _TYPES.items():
        if value == int(getattr(lib, cname)):
            return short
    return f"type{value}"


def _registry() -> dict:
    """name -> ggml_backend_dev_t of every device in ggml's registry, in registry order."""
    ffi, lib = bindings.load()
    devices = (lib.ggml_backend_dev_get(i) for i in range(int(lib.ggml_backend_dev_count())))
    return {ffi.string(lib.ggml_backend_dev_name(dev)).decode(): dev for dev in devices}


def list_devices() -> list[DeviceInfo]:
    """Every device in ggml's registry, in registry order."""
    ffi, lib = bindings.load()
    return [DeviceInfo(name, ffi.string(lib.ggml_backend_dev_description(dev)).decode(), _type_name(ffi, lib, dev))
            for name, dev in _registry().items()]


def _known(names: Sequence[str]) -> dict:
    """ggml's registry (name -> ggml_backend_dev_t); HeadInferError if one of ``names`` is not in it."""
    by_name = _registry()
    missing = [n for n in names if n not in by_name]
    if missing:
        raise HeadInferError(f"unknown device(s) {missing}; known: {sorted(by_name)}")
    return by_name


def device_free_bytes(names: Sequence[str]) -> int:
    """The free memory of the named devices together, in bytes, as ggml reports it."""
    ffi, lib = bindings.load()
    by_name = _known(names)
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    n = 0
    for name in names:
        lib.ggml_backend_dev_memory(by_name[name], free, total)
        n += int(free[0])
    return n


def device_handles(names: Sequence[str]):
    """A NULL-terminated ``ggml_backend_dev_t[]`` for the named devices (keep it alive while in use)."""
    ffi, lib = bindings.load()
    by_name = _known(names)
    cpus = [n for n in names if int(lib.ggml_backend_dev_type(by_name[n])) == int(lib.GGML_BACKEND_DEVICE_TYPE_CPU)]
    if cpus:  # as llama.cpp's --device: layers that are not offloaded stay on the CPU by themselves
        raise HeadInferError(f"{cpus[0]} is not an offload device; name GPUs or RPC devices "
                             "(n_gpu_layers decides what stays on the CPU)")
    if len(set(names)) != len(names):
        raise HeadInferError(f"a device is named twice in {list(names)}")
    return ffi.new("ggml_backend_dev_t[]", [by_name[n] for n in names] + [ffi.NULL])


def _rpc_proc(name: str, signature: str):
    ffi, lib = bindings.load()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if reg == ffi.NULL:
        raise HeadInferError("this build has no RPC backend: build with -DGGML_RPC=ON "
                             "(python -m pyllama_headinfer build -DGGML_RPC=ON)")
    fn = lib.ggml_backend_reg_get_proc_address(reg, name.encode())
    if fn == ffi.NULL:
        raise HeadInferError(f"the RPC backend of this build has no {name}")
    return ffi.cast(signature, fn)


def _check_endpoint(endpoint: str) -> tuple[str, int]:
    # ggml splits at the first ':' (no IPv6 literals) and aborts the process on what it cannot parse
    host, sep, port = str(endpoint).partition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"an RPC endpoint is host:port (a host name or IPv4 address), got {endpoint!r}")
    return host, int(port)


def _check_reachable(endpoint: str, timeout: float = 5.0) -> None:
    """ggml aborts the process when it cannot connect: try the connection here first."""
    host, port = _check_endpoint(endpoint)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise HeadInferError(f"cannot reach the RPC server {endpoint}: {exc}") from None


def rpc_add_server(endpoint: str) -> list[str]:
    """Connect to the RPC server at ``host:port``; returns the names of its devices.

    An unreachable endpoint is a :class:`HeadInferError`; a listener that is
    not a ggml RPC server of a compatible version still makes ggml abort the
    process during the handshake (upstream behaviour)."""
    ffi, lib = bindings.load()
    add = _rpc_proc("ggml_backend_rpc_add_server", "ggml_backend_reg_t (*)(const char *)")
    _check_reachable(endpoint)
    reg = checked_call(add, str(endpoint).encode(), ok=lambda r: r != ffi.NULL,
                       error=lambda _, reason: HeadInferError(f"could not add the RPC server {endpoint}: {reason}"))
    lib.ggml_backend_register(reg)  # into the global device list, as llama.cpp's --rpc does
    return [ffi.string(lib.ggml_backend_dev_name(lib.ggml_backend_reg_dev_get(reg, i))).decode()
            for i in range(int(lib.ggml_backend_reg_dev_count(reg)))]


def rpc_serve(endpoint: str, n_threads: int = 1) -> None:
    """Serve this process's CPU device over RPC at ``host:port``; does not return."""
    ffi, lib = bindings.load()
    start = _rpc_proc("ggml_backend_rpc_start_server",
                      "void (*)(const char *, const char *, size_t, size_t, ggml_backend_dev_t *)")
    cpu = lib.ggml_backend_dev_by_type(lib.GGML_BACKEND_DEVICE_TYPE_CPU)
    devices = ffi.new("ggml_backend_dev_t[]", [cpu])
    _check_endpoint(endpoint)
    start(str(endpoint).encode(), ffi.NULL, int(n_threads), 1, devices)
