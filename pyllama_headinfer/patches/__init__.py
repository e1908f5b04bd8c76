"""The patch manager: the HeadInfer series (the repository's ``patches/``
directory) against a llama.cpp tree -- apply and revert (:mod:`.apply`),
a tree's state (:mod:`.status`), a per-hunk check (:mod:`.check`), parsing
(:mod:`.series`), the workspace where ``git apply`` runs (:mod:`.workspace`),
regenerating the series from git (:mod:`.export`), re-targeting it to another
tree (:mod:`.retarget`) and checking its shape (:mod:`.lint`)."""
