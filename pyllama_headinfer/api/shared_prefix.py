"""n continuations of one prompt decoded together (behind
:meth:`Context.generate_shared`).

The prompt's KV cells are computed once and shared by n sequences
(``seq_cp`` in a unified cache adds the sequence ids to the same cells); then
every step decodes one token of each unfinished sequence in a single batch.
A step's attention reads the shared cells once for all n tokens -- with
HeadInfer, the host heads of the prefix cross the link once per step for all
n continuations instead of once per continuation (many questions about one
document, best-of-n sampling).
"""

from __future__ import annotations

import numbers
from typing import Sequence

from pyllama_headinfer.api.sampler import Sampler


def generate_shared(ctx, prompt_tokens: Sequence[int], n: int, max_tokens: int, samplers=None, *,
                    stop_at_eog: bool = True) -> list[list[int]]:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= ctx.n_seq_max:
        raise ValueError(f"n must be an int in [1, n_seq_max={ctx.n_seq_max}], got {n!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens < 0:
        raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
    if n > 1 and not ctx.kv_unified:
        raise ValueError("generate_shared() needs a unified KV cache (Context(..., kv_unified=True)): with one "
                         "stream per sequence the prefix would be copied n times instead of shared")
    prompt = ctx.model.check_tokens(prompt_tokens)
    if len(prompt) == 0:
        raise ValueError("generate_shared() needs a non-empty prompt")
    own = samplers is None
    samplers = [Sampler.greedy() for _ in range(n)] if own else list(samplers)
    if len(samplers) != n:
        raise ValueError(f"give one sampler per sequence: {len(samplers)} for n={n}")
    try:
        for s in range(n):
            ctx.seq_rm(s)
        ctx.decode(prompt, seq_id=0, logits="last")
        for s in range(1, n):
            ctx.seq_cp(0, s)
        outs: list[list[int]] = [[] for _ in range(n)]
        if max_tokens == 0:
            return outs
        # every sequence's first token comes from the prompt's logits
        nxt = {s: samplers[s].sample(ctx, -1) for s in range(n)}
        while nxt:
            for s, tok in nxt.items():
                outs[s].append(tok)
            nxt = {s: tok for s, tok in nxt.items()
                   if len(outs[s]) < max_tokens and not (stop_at_eog and ctx.model.is_eog(tok))
                   and ctx.n_tokens(s) < ctx.n_ctx_seq}
            if nxt:
                rows = ctx.decode_batch({s: [tok] for s, tok in nxt.items()})
                nxt = {s: samplers[s].sample(ctx, rows[s]) for s in nxt}
        return outs
    finally:
        if own:
            for sampler in samplers:
                sampler.close()
