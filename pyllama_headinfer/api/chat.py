"""Chat prompts through llama.cpp's own ``llama_chat_apply_template``
(behind :meth:`Model.apply_chat_template` and :meth:`Context.chat`).

llama.cpp recognises the model's template (the GGUF key
``tokenizer.chat_template``) among the formats it knows (chatml, llama3,
gemma, ...; no general Jinja engine); a model without one needs an explicit
``template`` -- a known name such as ``"chatml"`` or a template text.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from pyllama_headinfer.errors import ChatTemplateError

ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Sequence[Mapping[str, str]]) -> list:
    """``[{"role": ..., "content": ...}, ...]`` checked: a list of dicts with string role and content."""
    if isinstance(messages, (str, bytes)) or not hasattr(messages, "__iter__"):
        raise ChatTemplateError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"message {i} must be a dict with string 'role' and 'content', got {m!r}")
        out.append((m["role"], m["content"]))
    if not out:
        raise ChatTemplateError("messages is empty")
    return out


def apply_chat_template(model, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                        template: str | None = None) -> str:
    """The prompt text for ``messages`` in the model's chat format (or ``template``'s)."""
    ffi, lib = model._ffi, model._lib
    pairs = check_messages(messages)
    if template is None:
        ptr = lib.llama_model_chat_template(model._ptr(), ffi.NULL)
        if ptr == ffi.NULL:
            raise ChatTemplateError(f"{model.path.name} has no chat template (tokenizer.chat_template): "
                                    "give one, e.g. template='chatml'")
        tmpl = ffi.string(ptr)
    else:
        tmpl = str(template).encode()
    keep = [(ffi.new("char[]", r.encode()), ffi.new("char[]", c.encode())) for r, c in pairs]
    chat = ffi.new("llama_chat_message[]", len(keep))
    for slot, (role, content) in zip(chat, keep):
        slot.role, slot.content = role, content
    size = 2 * sum(len(r) + len(c) for r, c in pairs) + 256
    for _ in range(2):  # the first call returns the size needed when the buffer is too small
        buf = ffi.new("char[]", size)
        n = int(lib.llama_chat_apply_template(tmpl, chat, len(keep), bool(add_generation_prompt), buf, size))
        if n < 0:
            which = "the model's template" if template is None else f"template {template!r}"
            raise ChatTemplateError(f"llama.cpp does not support {which} (llama_chat_apply_template returned "
                                    f"{n}); give a known one, e.g. template='chatml'")
        if n <= size:
            return ffi.unpack(buf, n).decode("utf-8", "replace")
        size = n + 1
    raise ChatTemplateError("llama_chat_apply_template kept asking for a larger buffer")
