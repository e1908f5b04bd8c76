"""The implementation of the Python API, one job per module; users import
from :mod:`pyllama_headinfer.llama`, the public facade.

- :mod:`.handle` -- ``Handle``, the close / ``with`` / ClosedError lifetime
- :mod:`.model` -- ``Model``: loading, properties, tokenize / detokenize
- :mod:`.sampler` -- ``Sampler``: llama.cpp sampler chains
- :mod:`.context` -- ``Context``, made of :mod:`.decoding` (batches, decode,
  logits, generate, chat; :mod:`.shared_prefix`), :mod:`.sequences` (KV
  cache sequences) and :mod:`.state` (save / load; :mod:`.atomic_file`)
- :mod:`.chat` -- chat prompts through llama.cpp's templates
- :mod:`.residency` -- the HeadInfer KV residency report
- :mod:`.devices` -- devices and RPC servers
- :mod:`.gguf_check` -- ``check_gguf``, the GGUF pre-flight check
- :mod:`.bench` -- the speed/memory sweep behind the ``bench`` command

Imports run one way (handle, chat <- model <- sampler <- shared_prefix <-
decoding <- context), so there are no cycles; nothing here imports the build
tool (tests/test_layers.py).
"""
