"""The graph budget covers the split's extra nodes (issue 13.5).

llama.cpp sizes its graphs by a node budget (``graph_max_nodes``); a split
layer adds nodes (views, conversions, the host stores and the concatenation
of the two halves).  The budget is raised by that per-layer cost for every
split layer, so architectures with few tensors per layer cannot hit the
node-count assert.  Checked on llama.cpp's own numbers: the reserved
graph's node count (``graph: nodes = N``) and the budget (``max_nodes``).

(The split's exactness under every scenario -- also what 13.6's explicit
store-before-read edges must preserve -- is tests/test_kv_features.py.)
"""

from __future__ import annotations

import logging
import math
import re

import pytest

from testing_models import FORCE_SPLIT, SPECS

pytestmark = pytest.mark.usefixtures("residency_llama")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# the graph's layouts: one KV stream or one per sequence
LAYOUTS = {
    "joined": {},
    "joined-streams": {"headinfer_attn": "joined", "n_seq_max": 2, "kv_unified": False},
}


def graph_numbers(llama, model, frac, monkeypatch, layout="joined"):
    params = LAYOUTS[layout]
    monkeypatch.setenv(FORCE_SPLIT, "1")
    logger = llama.logger
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with llama.Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, flash_attn=True,
                           headinfer_gpu_heads_frac=frac, **params) as ctx:
            n_split = sum(x["n_head_resident"] < x["n_head_kv"] for x in ctx.kv_residency()["layers"])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    text = "\n".join(handler.messages)
    max_nodes = int(re.search(r"max_nodes = (\d+)", text).group(1))
    nodes = int(re.search(r"graph(?: \([^)]*\))?: nodes = (\d+)", text).group(1))
    return n_split, max_nodes, nodes


@pytest.mark.parametrize("name", list(SPECS))
def test_budget_covers_the_split_nodes(llama, models, monkeypatch, name):
    per_layer = {}
    for layout in LAYOUTS:
        n0, max0, nodes0 = graph_numbers(llama, models[name], 1.0, monkeypatch, layout)
        n1, max1, nodes1 = graph_numbers(llama, models[name], 0.5, monkeypatch, layout)
        assert n0 == 0 and n1 == SPECS[name].n_layer
        extra_nodes, extra_budget = nodes1 - nodes0, max1 - max0
        assert 0 < extra_nodes <= extra_budget, (layout, extra_nodes, extra_budget)
        per_layer[layout] = extra_nodes / n1
    # the raise is the per-layer cost of the costliest layout, not an arbitrary margin
    assert extra_budget == 27 * n1 and math.ceil(max(per_layer.values())) == 27, per_layer
    assert per_layer["joined"] == 26, per_layer  # the default: one stream, heads read joined
