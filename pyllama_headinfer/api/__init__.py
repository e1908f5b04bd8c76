"""The implementation of the Python API, one job per module.  Import from
:mod:`pyllama_headinfer.llama`, the public facade, not from here.

- :mod:`.exceptions` -- the exception types (``ModelError``, ``ClosedError``,
  ``ContextError``, ``DecodeError``, ``TokenError``, ``ContextOverflowError``,
  ``StateError``)
- :mod:`.gguf_check` -- ``check_gguf``, the GGUF pre-flight check (over the
  package's one GGUF reader, :mod:`pyllama_headinfer.gguf_meta`)
- :mod:`.model` -- ``Model``: loading, properties, tokenize / detokenize
- :mod:`.sampler` -- ``Sampler``: llama.cpp sampler chains
- :mod:`.context` -- ``Context``: decode, logits, generate, sequence ops,
  state; its parameters (``KV_CACHE_TYPES``, ``check_headinfer_frac``)
- :mod:`.residency` -- the HeadInfer KV residency report: reading it
  (behind ``Context.kv_residency``), ``format_kv_residency``,
  ``HEADINFER_HOST_SUFFIX``

Imports run one way (exceptions <- gguf_check <- model <- sampler <-
context; residency is used by context), so there are no cycles.
"""
