"""Chat roles through the tokenizer's own chat template.

A message's text is what the template renders for it in context: we render the conversation with a
marker as the message content and split at the marker, giving the text before and after the content.
The first message of a conversation may differ from later ones (templates that add a default system
prompt), so both cases are derived. Example for SmolLM2, a first ``user`` message:
``("<|im_start|>system\\nYou are a helpful AI assistant named SmolLM...<|im_end|>\\n<|im_start|>user\\n",
"<|im_end|>\\n")``.
"""

from __future__ import annotations

from treegen.lang.ir import ROLES

_MARK = "\x00TREEGEN-CONTENT\x00"
_SYSTEM, _USER, _ASSISTANT = ({"role": r, "content": c} for r, c in zip(ROLES, "xyz"))
# a natural conversation just before a later (not first) message of each role
_CONTEXT_BEFORE = {"system": [_SYSTEM, _USER, _ASSISTANT], "user": [_SYSTEM], "assistant": [_SYSTEM, _USER]}


def _render(tokenizer, messages) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False)


def role_affixes(tokenizer, role: str, first: bool) -> tuple[str, str]:
    """(text before the content, text after it) for a ``role`` message; ``first``: opens the conversation."""
    if role not in ROLES:
        raise ValueError(f"unknown chat role {role!r}; expected one of {', '.join(ROLES)}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer {type(tokenizer).__name__} has no chat template; append plain text instead of {role}(...)")
    cache = tokenizer.__dict__.setdefault("_treegen_role_affixes", {})
    if (role, first) not in cache:
        context = [] if first else _CONTEXT_BEFORE[role]
        before = _render(tokenizer, context)
        full = _render(tokenizer, context + [{"role": role, "content": _MARK}])
        if not full.startswith(before) or full.count(_MARK) != 1:
            raise ValueError(f"the chat template cannot render a {role} message on its own")
        prefix, suffix = full[len(before):].split(_MARK)
        cache[(role, first)] = (prefix, suffix)
    return cache[(role, first)]
