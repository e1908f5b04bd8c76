"""The build tool: configure and compile the patched llama.cpp and its cffi
bindings, and record the result in ``manifest.json`` (:mod:`.build` runs the
steps; its docstring says where each step lives)."""
