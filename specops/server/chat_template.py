"""Chat messages → one prompt string.

A tokenizer that ships a chat template (``tokenizer.chat_template``) renders with it
(``apply_chat_template(..., add_generation_prompt=True)``). The bundled tokenizer
has none — its models were trained on Python source and docstrings, not dialogue —
so `render_plain` gives it a small, readable transcript format:

    <system text>            (when a system / developer message is given)

    User: <text>
    Assistant: <text><|eos|>
    User: <text>
    Assistant:

An assistant turn in the history ends with the EOS token, so the model sees where
a reply stops; the prompt ends with ``Assistant:`` for the model to continue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROLE_NAMES = {"user": "User", "assistant": "Assistant", "tool": "Tool"}


def render_plain(messages: Sequence[tuple[str, str]], eos_token: str | None = None) -> str:
    """The bundled template over (role, text) pairs (see the module docstring)."""
    system = [text for role, text in messages if role in ("system", "developer") and text]
    lines: list[str] = []
    if system:
        lines.append("\n".join(system))
        lines.append("")
    for role, text in messages:
        if role in ("system", "developer"):
            continue
        end = (eos_token or "") if role == "assistant" else ""
        lines.append(f"{ROLE_NAMES[role]}: {text}{end}")
    lines.append("Assistant:")
    return "\n".join(lines)


def render_chat(messages: Sequence[tuple[str, str]], tokenizer: Any) -> str:
    """The prompt for ``messages`` with the tokenizer's own template, else `render_plain`."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in messages],
                                             tokenize=False, add_generation_prompt=True)
    return render_plain(messages, getattr(tokenizer, "eos_token", None))
