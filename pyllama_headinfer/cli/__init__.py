"""The command line: :mod:`.main` (``main(argv)``, the one place that maps
exceptions to exit codes) and one module per command -- :mod:`.source`,
:mod:`.patch`, :mod:`.build`, :mod:`.generate`, :mod:`.plan`, :mod:`.bench`,
:mod:`.serve` -- and :mod:`.options`, the options several of them share."""
