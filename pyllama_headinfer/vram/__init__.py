"""Plan before you load: the GGUF facts of a model (:mod:`.gguf`,
:mod:`.model`), the memory model of the pinned llama.cpp (:mod:`.memory`)
and the HeadInfer head fraction for a VRAM budget (:mod:`.plan`). Pure
Python over the GGUF metadata: no llama.cpp, no weights."""
