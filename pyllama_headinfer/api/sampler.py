""":class:`Sampler`: a llama.cpp sampler chain (greedy, or top-k / top-p /
min-p / temperature / seeded dist), which picks a token from a
:class:`~pyllama_headinfer.llama.Context`'s logits."""

from __future__ import annotations

import math

import numpy as np

from pyllama_headinfer.api.handle import Handle
from pyllama_headinfer.errors import HeadInferError
from pyllama_headinfer.runtime import bindings


class Sampler(Handle):
    """A llama.cpp sampler chain.

    ``Sampler.greedy()``, ``Sampler.random(temperature=.., top_k=.., top_p=..,
    min_p=.., seed=..)``, ``Sampler.from_params(...)`` (greedy when
    ``temperature <= 0``) or step by step:
    ``Sampler().add_top_k(40).add_temp(0.7).add_dist(seed=1)``.
    The chain must end with a selecting stage (greedy or dist) to sample.
    """

    _SELECTING = ("greedy", "dist")
    _kind = "sampler"

    def __init__(self, *, no_perf: bool = True):
        ffi, lib = self._ffi, self._lib = bindings.load()
        params = lib.llama_sampler_chain_default_params()
        params.no_perf = bool(no_perf)
        ptr = lib.llama_sampler_chain_init(params)
        if ptr == ffi.NULL:
            raise HeadInferError("llama_sampler_chain_init failed")
        self._handle = ffi.gc(ptr, lib.llama_sampler_free)
        self.stages: list[str] = []
        self._seed: int | None = None

    @classmethod
    def greedy(cls) -> "Sampler":
        return cls().add_greedy()

    @classmethod
    def random(cls, temperature: float = 0.8, top_k: int | None = 40, top_p: float | None = 0.95,
               min_p: float | None = 0.05, seed: int | None = None) -> "Sampler":
        _check_truncation(top_k, top_p, min_p)
        s = cls()
        if top_k:
            s.add_top_k(top_k)
        if top_p is not None and top_p < 1.0:
            s.add_top_p(top_p)
        if min_p:
            s.add_min_p(min_p)
        return s.add_temp(temperature).add_dist(seed)

    @classmethod
    def from_params(cls, temperature: float = 0.8, top_k: int | None = 40, top_p: float | None = 0.95,
                    min_p: float | None = 0.05, seed: int | None = None) -> "Sampler":
        if temperature is not None and math.isnan(float(temperature)):
            raise ValueError("temperature must not be NaN")
        _check_truncation(top_k, top_p, min_p)  # also for greedy: a bad value is a mistake either way
        if temperature is None or temperature <= 0:
            return cls.greedy()
        return cls.random(temperature, top_k, top_p, min_p, seed)

    def _add(self, name: str, ptr) -> "Sampler":
        chain = self._ptr()
        if self.stages and self.stages[-1] in self._SELECTING:
            raise ValueError(f"cannot add {name!r} after the selecting stage {self.stages[-1]!r}")
        if ptr == self._ffi.NULL:
            raise ValueError(f"llama.cpp rejected the {name} sampler parameters")
        self._lib.llama_sampler_chain_add(chain, ptr)  # the chain owns it now
        self.stages.append(name)
        return self

    def add_greedy(self) -> "Sampler":
        return self._add("greedy", self._lib.llama_sampler_init_greedy())

    def add_dist(self, seed: int | None = None) -> "Sampler":
        lib = self._lib
        s = int(lib.LLAMA_DEFAULT_SEED) if seed is None else int(seed) & 0xFFFFFFFF
        self._add("dist", lib.llama_sampler_init_dist(s))
        self._seed = int(lib.llama_sampler_get_seed(self._ptr()))
        return self

    def add_temp(self, t: float) -> "Sampler":
        t = float(t)
        if math.isnan(t):
            raise ValueError("temperature must not be NaN")
        return self._add("temp", self._lib.llama_sampler_init_temp(t))

    def add_top_k(self, k: int) -> "Sampler":
        return self._add("top_k", self._lib.llama_sampler_init_top_k(int(k)))

    def add_top_p(self, p: float, min_keep: int = 1) -> "Sampler":
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {p!r}")
        return self._add("top_p", self._lib.llama_sampler_init_top_p(float(p), int(min_keep)))

    def add_min_p(self, p: float, min_keep: int = 1) -> "Sampler":
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {p!r}")
        return self._add("min_p", self._lib.llama_sampler_init_min_p(float(p), int(min_keep)))

    @property
    def seed(self) -> int | None:
        """The seed the dist stage actually uses (None without one)."""
        return self._seed

    def sample(self, ctx, idx: int = -1) -> int:
        """Sample a token from the logits of ``ctx`` (a :class:`Context`; this
        module does not import it: the context imports the sampler) at
        ``idx``, and accept it.

        Logits that a loaded state brought (not in llama.cpp's output buffer)
        are sampled the way ``llama_sampler_sample`` samples that buffer: the
        same candidates, the chain applied, the selected token accepted."""
        chain = self._ptr()
        if not self.stages or self.stages[-1] not in self._SELECTING:
            raise ValueError("the sampler chain does not end with a selecting stage (greedy or dist)")
        cptr = ctx._ptr()
        row = ctx._held_row(idx)  # raises if there are no logits at idx
        if row is not None:
            return self._sample_row(chain, row)
        ctx._logits_ptr(idx)  # raises if there are no logits at idx (llama.cpp would abort)
        return int(self._lib.llama_sampler_sample(chain, cptr, int(idx)))

    def _sample_row(self, chain, logits: np.ndarray) -> int:
        """``llama_sampler_sample`` on a row of logits held in Python (llama-sampler.cpp at the pin:
        candidates ``{id, logit, p = 0}`` for every token, unsorted, nothing selected; apply the chain;
        accept the selected token)."""
        ffi, lib = self._ffi, self._lib
        n = len(logits)
        data = ffi.new("llama_token_data[]", n)
        fields = np.dtype({"names": ["id", "logit", "p"], "formats": ["<i4", "<f4", "<f4"],
                           "offsets": [ffi.offsetof("llama_token_data", f) for f in ("id", "logit", "p")],
                           "itemsize": ffi.sizeof("llama_token_data")})
        view = np.frombuffer(ffi.buffer(data), dtype=fields)
        view["id"], view["logit"], view["p"] = np.arange(n, dtype=np.int32), logits, 0.0
        cur = ffi.new("llama_token_data_array *")
        cur.data, cur.size, cur.selected, cur.sorted = data, n, -1, False
        lib.llama_sampler_apply(chain, cur)
        if not 0 <= cur.selected < cur.size:
            raise HeadInferError(f"the sampler chain selected no token (selected = {cur.selected})")
        token = int(cur.data[cur.selected].id)
        lib.llama_sampler_accept(chain, token)
        return token

    def accept(self, token: int) -> None:
        self._lib.llama_sampler_accept(self._ptr(), int(token))

    def reset(self) -> None:
        self._lib.llama_sampler_reset(self._ptr())

    def __repr__(self) -> str:
        return f"<Sampler {' -> '.join(self.stages) or '(empty)'}{' closed' if self._handle is None else ''}>"


def _check_truncation(top_k, top_p, min_p) -> None:
    """Range checks before a stage is skipped as "off" (top_p 7 is a mistake, not "no top-p")."""
    if top_p is not None and not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 0):
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if min_p is not None and not 0.0 <= float(min_p) <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p!r}")
