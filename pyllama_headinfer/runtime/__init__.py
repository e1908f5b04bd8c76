"""The runtime: finding a finished build and loading its checked cffi bindings.

- :mod:`.manifest` -- the build's ``manifest.json`` as a typed record
  (:class:`~.manifest.Manifest`), :func:`~.manifest.find_manifest`;
- :mod:`.bindings` -- :func:`~.bindings.load`: import the extension module,
  check its stamp and ABI, route the log;
- :mod:`.log` -- llama.cpp's log to the ``pyllama_headinfer.llama`` logger,
  :func:`~.log.capture_log`, :func:`~.log.checked_call`.

Nothing here imports the build tool, the patch manager or the source manager
(tests/test_layers.py enforces it): loading a model runs no subprocess.
"""
