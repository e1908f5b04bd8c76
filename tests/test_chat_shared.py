"""Chat prompts through llama.cpp's template code, and n continuations of one
shared prefix decoded together (issue 14.4, 14.5)."""

from __future__ import annotations

import pytest

from testing_models import CORPUS, FORCE_SPLIT

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
CHATML = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen(llama, gguf_models):
    with llama.Model(gguf_models["qwen2"]) as m:
        yield m


def test_chat_template_by_name(qwen):
    assert qwen.apply_chat_template(MESSAGES, template="chatml") == CHATML
    assert qwen.apply_chat_template(MESSAGES, add_generation_prompt=False, template="chatml") == \
        CHATML[: -len("<|im_start|>assistant\n")]


def test_chat_template_errors(llama, qwen):
    from pyllama_headinfer.errors import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="has no chat template"):
        qwen.apply_chat_template(MESSAGES)
    with pytest.raises(ChatTemplateError, match="does not support template 'no-such-format'"):
        qwen.apply_chat_template(MESSAGES, template="no-such-format")
    for bad in ("hello", [], [{"role": "user"}], [{"role": 1, "content": "x"}], [("user", "x")]):
        with pytest.raises(ValueError):
            qwen.apply_chat_template(bad, template="chatml")


def test_context_chat_is_template_plus_generate(llama, qwen):
    with llama.Context(qwen, n_ctx=256, n_threads=1) as ctx:
        reply = ctx.chat(MESSAGES, max_tokens=12, template="chatml")
        prompt = qwen.tokenize(CHATML, add_special=True, parse_special=True)
        assert qwen.tokenize(CHATML, parse_special=False) != prompt  # the specials became control tokens
        manual = [t for t in ctx.generate(prompt, 12) if not qwen.is_eog(t)]
        assert isinstance(reply, str) and reply == qwen.detokenize(manual)


def _shared(llama, model, prompt, frac, seeds=(1, 2, 3, 4), n_tokens=16):
    with llama.Context(model, n_ctx=512, n_seq_max=4, kv_unified=True, n_threads=1,
                       headinfer_gpu_heads_frac=frac) as c:
        samplers = [llama.Sampler.random(temperature=0.9, top_k=0, top_p=None, min_p=None, seed=seed)
                    for seed in seeds]
        try:
            seeded = c.generate_shared(prompt, len(seeds), n_tokens, samplers, stop_at_eog=False)
        finally:
            for s in samplers:
                s.close()
        greedy = c.generate_shared(prompt, 3, n_tokens, stop_at_eog=False)
        assert c.n_tokens(0) == len(prompt) + n_tokens - 1 and c.n_tokens(2) == len(prompt) + n_tokens - 1
        return seeded, greedy


def test_shared_prefix_continuations(llama, gguf_models, monkeypatch):
    """n continuations of one prefix in one batch per step: bit-identical with and without the
    split; under greedy decoding the same tokens as one sequence decoded alone.

    (Not bit-identical to separate runs: llama.cpp's CPU matrix kernels round a batch of n
    tokens differently from a batch of one -- ~1e-3 in these logits, with or without HeadInfer --
    so seeded sampling may part from a separate run after a near-tie.)"""
    monkeypatch.setenv(FORCE_SPLIT, "1")
    with llama.Model(gguf_models["llama-gqa"]) as model:
        prompt = model.tokenize(CORPUS)[:48]
        whole = _shared(llama, model, prompt, 1.0)
        split = _shared(llama, model, prompt, 0.5)
        with llama.Context(model, n_ctx=512, n_threads=1, headinfer_gpu_heads_frac=0.5) as c:
            alone = list(c.generate(prompt, 16, stop_at_eog=False))
    assert split == whole
    seeded, greedy = split
    assert len({tuple(t) for t in seeded}) == 4  # four different continuations, not one copied
    assert greedy == [alone] * 3


def test_shared_prefix_input_errors(llama, gguf_models):
    with llama.Model(gguf_models["llama-gqa"]) as model:
        prompt = model.tokenize(CORPUS)[:8]
        with llama.Context(model, n_ctx=256, n_seq_max=2, kv_unified=False, n_threads=1) as c:
            with pytest.raises(ValueError, match="unified KV cache"):
                c.generate_shared(prompt, 2, 4)
        with llama.Context(model, n_ctx=256, n_seq_max=2, kv_unified=True, n_threads=1) as c:
            with pytest.raises(ValueError, match="n must be an int in"):
                c.generate_shared(prompt, 3, 4)
            with pytest.raises(ValueError, match="one sampler per sequence"):
                c.generate_shared(prompt, 2, 4, [llama.Sampler.greedy()])
            with pytest.raises(ValueError, match="non-empty prompt"):
                c.generate_shared([], 2, 4)
            assert c.generate_shared(prompt, 2, 0) == [[], []]
