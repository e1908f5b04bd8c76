"""The pinned llama.cpp source: getting a verified tree (:mod:`.fetch`),
hashing and comparing trees with the pin (:mod:`.tree_verify`), extracting
archives safely (:mod:`.archive`)."""
