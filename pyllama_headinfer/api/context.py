""":class:`Context`: an inference context on a :class:`~.model.Model`.

Its parameters are one :class:`~pyllama_headinfer.params.ContextParams`
(checked before anything reaches llama.cpp); its jobs live in mixins, one
module each: :mod:`.decoding` (batches, decode, logits, generate),
:mod:`.sequences` (the KV cache's sequences), :mod:`.state` (save/load);
the HeadInfer residency report is read by :mod:`.residency`.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings

from pyllama_headinfer.api.decoding import Decoding
from pyllama_headinfer.api.handle import Handle, serialized
from pyllama_headinfer.api.model import Model
from pyllama_headinfer.api.residency import kv_residency_totals, read_kv_residency
from pyllama_headinfer.api.sequences import Sequences
from pyllama_headinfer.api.state import StateIO
from pyllama_headinfer.errors import ContextError, HeadInferWarning
from pyllama_headinfer.params import AUTO_VRAM_BUDGET, HEADINFER_ATTN_TYPES, ContextParams, format_bytes
from pyllama_headinfer.runtime.log import capture_log, checked_call
from pyllama_headinfer.vram.plan import (AUTO_VRAM_BUDGET_MARGIN, Plan, auto_vram_budget, plan_for_context,
                                         plan_kv)

# The API's logger keeps the name of the public module (documented, and what
# the runtime routes llama.cpp's own log to).
logger = logging.getLogger("pyllama_headinfer.llama")


def resolve_vram_budget(model: Model, params: ContextParams) -> ContextParams:
    """``params`` with ``headinfer_vram_budget="auto"`` replaced by bytes (:func:`~.vram.plan.auto_vram_budget`): the
    free memory of the model's devices (every GPU when it was not given any; the CPU on a build without one, where
    only LLAMA_HEADINFER_FORCE_SPLIT=1 splits), less 1 GiB per device as llama.cpp's ``--fit`` leaves, plus the weights
    the model has on them already."""
    if params.headinfer_vram_budget != AUTO_VRAM_BUDGET:
        return params
    from pyllama_headinfer.api.devices import device_free_bytes, list_devices

    names = model.devices or [d.name for d in list_devices() if d.type == "gpu"] or ["CPU"]
    free = device_free_bytes(names)
    budget = auto_vram_budget(model.gguf, model.n_gpu_layers, free, len(names),
                              gpu_offload=bool(model._lib.llama_supports_gpu_offload()))
    logger.info("headinfer_vram_budget 'auto': %s free on %s, %s margin: a budget of %s with the weights",
                format_bytes(free), ", ".join(names), format_bytes(AUTO_VRAM_BUDGET_MARGIN * len(names)),
                format_bytes(budget))
    return params.replace(headinfer_vram_budget=budget)


_HUGE_N_CTX = 1 << 20  # above this (and the model's training context) the KV size is checked first


def _check_kv_fits_the_machine(model: Model, params: ContextParams, ffi, lib) -> None:
    """Refuse a context whose KV cache alone exceeds all the memory of this
    machine (RAM + devices): llama.cpp would spend a long time (30 s for
    n_ctx = 2**31 - 1) before failing with std::bad_alloc."""
    try:
        whole = params.replace(headinfer_gpu_heads_frac=None, headinfer_vram_budget=None)
        row = plan_kv(model.gguf, whole).rows[-1]  # g = n_head_kv: the whole cache
    except Exception as exc:  # noqa: BLE001 - an estimate only; llama.cpp has the last word
        logger.debug("no KV size estimate before creating the context: %s", exc)
        return
    kv = row.device_kv + row.host_kv
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        if lib.ggml_backend_dev_type(dev) != lib.GGML_BACKEND_DEVICE_TYPE_CPU:
            lib.ggml_backend_dev_memory(dev, free, total)
            memory += int(total[0])
    if kv > memory:
        raise ContextError(f"n_ctx={params.n_ctx} needs {format_bytes(kv)} of KV cache "
                           f"({params.type_k}/{params.type_v}), more than all the memory of this machine "
                           f"({format_bytes(memory)}, RAM and devices)")


class Context(Decoding, Sequences, StateIO, Handle):
    """An inference context (KV cache, logits, threads) on a :class:`Model`.

    ``Context(model, params)`` with a :class:`ContextParams`, or its fields as
    keywords: ``Context(model, n_ctx=4096, headinfer_gpu_heads_frac=0.5)``
    (keywords given with ``params`` replace its fields).

    ``headinfer_gpu_heads_frac``: fraction of each layer's KV heads kept in
    the layer's (device) buffer; the rest live in host memory (HeadInfer).
    Not given: 1.0 = off.  ``headinfer_vram_budget`` (bytes or e.g.
    "24GiB", instead of a fraction): the fraction is derived from the budget
    at load time -- the largest g whose estimated device total fits (see
    :mod:`pyllama_headinfer.vram.plan`; the plan is kept as
    ``headinfer_plan``). ``headinfer_gpu_heads_frac`` is the fraction used.
    A fraction < 1 that splits no layer gives a :class:`HeadInferWarning`
    (with llama.cpp's reasons); one that does, an INFO log line.

    Threads: a Context may be shared between threads; its operations are
    serialized by a lock (llama.cpp's context is not thread-safe: two
    concurrent decodes abort the process). Each call holds the lock while it
    runs, and a :meth:`generate` generator holds it from its first token
    until it is exhausted or closed, so two threads generating on one
    Context get the same tokens as if they had run one after the other.
    For parallel work, use one Context per thread (they share the Model).
    A generator left suspended blocks other threads: consume it or
    ``close()`` it.
    """

    _kind = "context"

    def __init__(self, model: Model, params: ContextParams | None = None, **kwargs):
        self._handle = None
        self._batch = None
        self._lock = threading.RLock()
        if params is None:
            params = ContextParams(**kwargs)
        elif not isinstance(params, ContextParams):
            raise TypeError(f"params must be a ContextParams, got {params!r} (give n_ctx=... by keyword)")
        elif kwargs:
            params = params.replace(**kwargs)
        if not isinstance(model, Model):
            raise TypeError(f"model must be a Model, got {type(model).__name__}")
        mptr = model._ptr()
        ffi, lib = self._ffi, self._lib = model._ffi, model._lib
        params = resolve_vram_budget(model, params)
        self.params = params  # with "auto" resolved to the bytes it stood for
        self.headinfer_plan: Plan | None = None
        frac = params.frac if params.headinfer_vram_budget is None else self._frac_for_budget(model, params)

        p = lib.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max
        p.n_threads, p.n_threads_batch = params.threads()  # not given: the CPUs this process may run on
        p.flash_attn_type = {True: lib.LLAMA_FLASH_ATTN_TYPE_ENABLED, False: lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                             None: lib.LLAMA_FLASH_ATTN_TYPE_AUTO}[params.flash_attn]
        p.type_k = getattr(lib, f"GGML_TYPE_{params.type_k.upper()}")
        p.type_v = getattr(lib, f"GGML_TYPE_{params.type_v.upper()}")
        p.offload_kqv = params.offload_kqv
        if params.kv_unified is not None:
            p.kv_unified = params.kv_unified
        if params.swa_full is not None:
            p.swa_full = params.swa_full
        p.headinfer_gpu_heads_frac = frac
        p.headinfer_attn = getattr(lib, HEADINFER_ATTN_TYPES[params.headinfer_attn])
        p.headinfer_attn_chunk = params.headinfer_attn_chunk
        if params.n_ctx > max(model.n_ctx_train, _HUGE_N_CTX):
            _check_kv_fits_the_machine(model, params, ffi, lib)
        with capture_log() as log:  # also for _report_split: llama.cpp's reasons for not splitting
            ptr = checked_call(lib.llama_init_from_model, mptr, p, ok=lambda c: c != ffi.NULL,
                               error=lambda _, reason: ContextError(f"llama.cpp could not create the context: "
                                                                    f"{reason}"))
        self._handle = ffi.gc(ptr, lib.llama_free)
        self.model = model
        model._contexts.add(self)
        self.headinfer_gpu_heads_frac = frac
        self._mem = lib.llama_get_memory(ptr)
        self.n_ctx = int(lib.llama_n_ctx(ptr))
        self.n_ctx_requested = params.n_ctx  # 0 = the model's training context
        self.n_ctx_seq = int(lib.llama_n_ctx_seq(ptr))
        self.n_batch = int(lib.llama_n_batch(ptr))
        self.n_ubatch = int(lib.llama_n_ubatch(ptr))
        self.n_seq_max = int(lib.llama_n_seq_max(ptr))
        self.n_threads, self.n_threads_batch = int(p.n_threads), int(p.n_threads_batch)
        self.kv_unified = bool(p.kv_unified)  # False with n_seq_max > 1: one KV stream per sequence
        self.type_k, self.type_v = params.type_k, params.type_v
        self.n_vocab = model.n_vocab
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        if frac < 1.0:
            self._report_split(frac, log)

    def _report_split(self, frac: float, log) -> None:
        """Say what became of a fraction < 1, where a user sees it by default:
        an INFO log line when layers were split, a :class:`HeadInferWarning`
        when none was (the decision from the residency report; the reasons
        from llama.cpp's log of the context's creation)."""
        report = self.kv_residency()
        layers = report["layers"] if report else []
        n_split = sum(1 for x in layers if x["n_head_resident"] < x["n_head_kv"])
        if n_split:
            device, host = kv_residency_totals(report)
            logger.info("headinfer_gpu_heads_frac = %g: %d of %d KV layers split; KV %.1f MiB in the layers' "
                        "buffers, %.1f MiB in host memory", frac, n_split, len(layers), device / 2**20, host / 2**20)
            return
        reasons = sorted({t.split("not split:", 1)[1].strip() for _, t in log if "not split:" in t}
                         | {t.split("ignored:", 1)[1].strip() for _, t in log if "headinfer" in t and "ignored:" in t})
        why = "; ".join(reasons) if reasons else ("this context has no attention KV cache" if report is None
                                                  else "llama.cpp gave no reason")
        warnings.warn(f"headinfer_gpu_heads_frac = {frac:g} is ignored: no KV layer was split ({why}); "
                      "the whole KV cache stays in the layers' buffers", HeadInferWarning, stacklevel=3)

    def _frac_for_budget(self, model: Model, params: ContextParams) -> float:
        """The fraction for ``params.headinfer_vram_budget``, planned from the
        GGUF the model read already (see :func:`~pyllama_headinfer.vram.plan.plan_for_context`)."""
        budget = params.headinfer_vram_budget
        plan = plan_for_context(model.gguf, params, n_gpu_layers=model.n_gpu_layers,
                                gpu_offload=bool(self._lib.llama_supports_gpu_offload()))
        if plan is None:
            logger.warning("headinfer_vram_budget %r ignored: this build has no GPU offload (nothing to budget); "
                           "headinfer_gpu_heads_frac = 1.0", budget)
            return 1.0
        self.headinfer_plan = plan
        r = plan.chosen
        logger.info("headinfer_vram_budget %s: g = %d of %d KV heads on the device, headinfer_gpu_heads_frac = %.6g "
                    "(estimated device total %s, %s of KV in host memory)", format_bytes(plan.budget), r.g,
                    plan.n_head_kv, r.frac, format_bytes(r.device_total), format_bytes(r.host_kv))
        return r.frac

    # -- lifetime (Handle) -------------------------------------------------- #

    @serialized
    def close(self) -> None:
        super().close()

    def _close_dependents(self) -> None:
        if self._batch is not None:
            batch, self._batch = self._batch, None
            self._lib.llama_batch_free(batch)
        self._all_logits = self._held_logits = None
        self._mem = None
        self.model._contexts.discard(self)

    def __repr__(self) -> str:
        if self.closed:
            return "<Context closed>"
        return f"<Context n_ctx={self.n_ctx} headinfer_gpu_heads_frac={self.headinfer_gpu_heads_frac}>"

    # -- HeadInfer ---------------------------------------------------------- #

    @serialized
    def kv_residency(self) -> dict | None:
        """Where the KV cache's bytes live, as allocated by llama.cpp
        (``llama_memory_get_kv_buffers`` / ``_layers``; nothing is recomputed here)::

            {"buffers": {"CPU": {"k": 98304, "v": 98304, "headinfer_host": False},
                         "CPU (headinfer host)": {"k": ..., "v": ..., "headinfer_host": True}},
             "layers": [{"il": 0, "n_head_kv": 4, "n_head_resident": 2, "is_swa": False}, ...]}

        Buffers are keyed by buffer type name, with " (headinfer host)"
        appended for the separately allocated host halves of split layers.
        None when the context has no attention KV cache.  Raises
        :class:`HeadInferError` if libllama lacks the residency functions.
        """
        return read_kv_residency(self._ptr(), self._ffi, self._lib)
