"""The HeadInfer KV residency report: where the KV cache's bytes live, as
allocated by llama.cpp.  :func:`read_kv_residency` reads it (behind
:meth:`Context.kv_residency`), :func:`format_kv_residency` prints it as a
table; :data:`HEADINFER_HOST_SUFFIX` marks the host halves of split layers."""

from __future__ import annotations

from pyllama_headinfer.runtime.manifest import rebuild_hint
from pyllama_headinfer.errors import HeadInferError

HEADINFER_HOST_SUFFIX = " (headinfer host)"


def read_kv_residency(ptr, ffi, lib) -> dict | None:
    """The report of :meth:`Context.kv_residency` for the context ``ptr``
    (see there for its shape)."""
    if not lib.pyllama_has_kv_residency():
        raise HeadInferError("this libllama has no llama_memory_get_kv_buffers (built without the "
                             "HeadInfer patch series?); " + rebuild_hint())
    mem = lib.llama_get_memory(ptr)
    n = int(lib.llama_memory_get_kv_buffers(mem, ffi.NULL, 0))
    if n < 0:
        return None
    bufs = ffi.new("struct llama_memory_kv_buffer[]", max(n, 1))
    n = min(n, int(lib.llama_memory_get_kv_buffers(mem, bufs, n)))
    buffers: dict[str, dict] = {}
    for b in bufs[0:n]:
        name = ffi.string(b.buft_name).decode("utf-8", "replace") if b.buft_name != ffi.NULL else "?"
        host = bool(b.headinfer_host)
        key = name + (HEADINFER_HOST_SUFFIX if host else "")
        entry = buffers.setdefault(key, {"k": 0, "v": 0, "headinfer_host": host})
        entry["k"] += int(b.k_bytes)
        entry["v"] += int(b.v_bytes)
    nl = int(lib.llama_memory_get_kv_layers(mem, ffi.NULL, 0))
    layers = []
    if nl > 0:
        arr = ffi.new("struct llama_memory_kv_layer[]", nl)
        nl = min(nl, int(lib.llama_memory_get_kv_layers(mem, arr, nl)))
        layers = [{"il": int(x.il), "n_head_kv": int(x.n_head_kv), "n_head_resident": int(x.n_head_resident),
                   "is_swa": bool(x.is_swa)} for x in arr[0:nl]]
        layers.sort(key=lambda x: (x["il"], x["is_swa"]))
    return {"buffers": buffers, "layers": layers}


def kv_residency_totals(report: dict | None) -> tuple[int, int]:
    """(K+V bytes in the layers' own buffers -- the GPU's when offloaded --, K+V bytes in the
    HeadInfer host halves) of a :meth:`Context.kv_residency` report; (0, 0) for None."""
    if report is None:
        return 0, 0
    buffers = report["buffers"].values()
    return (sum(b["k"] + b["v"] for b in buffers if not b["headinfer_host"]),
            sum(b["k"] + b["v"] for b in buffers if b["headinfer_host"]))


def format_kv_residency(report: dict | None) -> str:
    """A human-readable table of :meth:`Context.kv_residency`."""
    if report is None:
        return "KV residency: no attention KV cache"

    def mib(n: int) -> str:
        return f"{n / 2**20:9.2f} MiB"

    lines = ["KV residency (as allocated by llama.cpp):"]
    total_k = total_v = 0
    for name, b in report["buffers"].items():
        lines.append(f"  {name:28s} K {mib(b['k'])}  V {mib(b['v'])}")
        total_k += b["k"]
        total_v += b["v"]
    lines.append(f"  {'total':28s} K {mib(total_k)}  V {mib(total_v)}")
    layers = report["layers"]
    if layers:
        split = [x for x in layers if x["n_head_resident"] < x["n_head_kv"]]
        lines.append(f"  layers: {len(layers)}, split: {len(split)}")
        for x in layers:
            tag = " swa" if x["is_swa"] else ""
            lines.append(f"    layer {x['il']:3d}: {x['n_head_resident']}/{x['n_head_kv']} heads resident{tag}")
    return "\n".join(lines)


def split_summary(report: dict | None) -> str:
    """One line on the split llama.cpp made, from a residency report: how many
    attention layers keep only part of their KV heads in their own buffer."""
    if report is None:
        return "no attention KV cache"
    layers = report["layers"]
    split = [x for x in layers if x["n_head_resident"] < x["n_head_kv"]]
    if not split:
        return f"0 of {len(layers)} layers split"  # why: the HeadInferWarning Context gave
    heads = sorted({f"{x['n_head_resident']}/{x['n_head_kv']}" for x in split})
    return f"{len(split)} of {len(layers)} layers split ({', '.join(heads)} KV heads in the layer's own buffer)"
