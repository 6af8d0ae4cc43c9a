"""The multi-turn ``chat`` benchmark suite: first replies vs follow-up turns.

Conversations are assembled from the held-out stdlib text the other suites use (no
model in the loop, so the suite is the same for every method and run): conversation
``c`` alternates user and assistant messages cut from held-out code and docstrings.
The prompt for turn ``k`` is the conversation so far — ``k`` user messages and the
``k - 1`` assistant replies between them — rendered with a chat template string, then
the assistant generation prompt. Each prompt's ``kind`` is its turn bucket
(``turn1``, ``turn2``, ``turn3+``), so the report's ``by_kind`` gives acceptance and
speed per turn.

A template is a Python format string with ``{role}`` and ``{content}`` per message;
the generation prompt is the template with ``role=assistant`` cut before ``{content}``.

**Chat-model suites** (`chat_model_suite`): for an instruction-tuned model the suites
come from prompt sets written for the project (`specops.bench.chat_prompts`) instead:
``chat`` (multi-turn, kinds ``turn1`` / ``turn2`` / ``turn3+``), ``code``, ``qa``
(factual questions) and ``creative`` (temperature `CREATIVE_TEMPERATURE`); ``mixed``
interleaves all four, one prompt of each class in turn, so ``--limit`` keeps the mix.
Each prompt is the messages rendered with the model's own chat template
(``tokenizer.apply_chat_template(..., add_generation_prompt=True)``, as `specops serve`
renders a chat request), or, for a tokenizer without one, with ``template`` when given,
else the server's plain transcript format (`specops.server.chat_template.render_plain`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specops.policies.turns import turn_bucket

DEFAULT_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
TURN_KINDS = ("turn1", "turn2", "turn3+")

CHAT_MODEL_SUITES = ("chat", "code", "qa", "creative", "mixed")
"""Suites from the shipped prompt sets for instruction-tuned models (`specops.bench.chat_prompts`)."""
CHAT_MODEL_CLASSES = ("chat", "code", "qa", "creative")
CREATIVE_TEMPERATURE = 0.8
"""The creative class is sampled (exactness is checked on the greedy classes only)."""


class ChatTemplateError(ValueError):
    """Raised for a chat template without exactly one ``{role}`` and one ``{content}``."""


@dataclass(frozen=True)
class ChatTemplate:
    """A per-message template such as ``<|{role}|>\\n{content}\\n``."""

    text: str = DEFAULT_CHAT_TEMPLATE

    def __post_init__(self) -> None:
        if self.text.count("{role}") != 1 or self.text.count("{content}") != 1:
            raise ChatTemplateError("a chat template needs exactly one {role} and one {content}, "
                                    f"got {self.text!r}")
        if self.text.index("{role}") > self.text.index("{content}"):
            raise ChatTemplateError("a chat template must name {role} before {content}")

    def message(self, role: str, content: str) -> str:
        return self.text.replace("{role}", role).replace("{content}", content)

    def generation_prompt(self) -> str:
        return self.text[: self.text.index("{content}")].replace("{role}", "assistant")

    def render(self, messages: list[tuple[str, str]]) -> str:
        """The conversation ``[(role, content), ...]`` followed by the assistant generation prompt."""
        return "".join(self.message(role, content) for role, content in messages) + self.generation_prompt()


def chat_conversations(snippets: list[str], *, turns: int) -> list[list[tuple[str, str]]]:
    """Conversations of ``2 * turns - 1`` messages (user, assistant, user, ...) from consecutive snippets."""
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    size = 2 * turns - 1
    conversations = []
    for start in range(0, len(snippets) - size + 1, size):
        chunk = snippets[start: start + size]
        conversations.append([("user" if i % 2 == 0 else "assistant", text.strip("\n")) for i, text in enumerate(chunk)])
    return conversations


def turn_prompts(conversation: list[tuple[str, str]], template: ChatTemplate) -> list[tuple[int, str]]:
    """(turn, rendered prompt) for every user message of ``conversation``."""
    out = []
    for i, (role, _) in enumerate(conversation):
        if role == "user":
            turn = 1 + sum(1 for r, _ in conversation[:i] if r == "assistant")
            out.append((turn, template.render(conversation[: i + 1])))
    return out


def turn_kind(turn: int) -> str:
    """Bench prompt kind for a turn: ``turn1`` / ``turn2`` / ``turn3+`` (bounded, like the telemetry label)."""
    return "turn" + (turn_bucket(turn) or "1")


def format_kind_table(report: dict) -> str:
    """`format_turn_table` over every kind of the report: chat turns first, then the chat-model
    classes, then any other kind (a mixed suite's per-class figures)."""
    present = report.get("prompt_kinds", [])
    order = [k for k in TURN_KINDS + CHAT_MODEL_CLASSES if k in present]
    return format_turn_table(report, kinds=order + sorted(k for k in present if k not in order), label="kind")


def format_turn_table(report: dict, *, kinds: list[str] | None = None, label: str = "turn") -> str:
    """Per-method, per-turn acceptance, tokens/s and tokens per target forward (the report's ``by_kind``);
    ``kinds``: the kinds to list, in order (default: the chat turns present)."""
    if kinds is None:
        kinds = [k for k in TURN_KINDS if k in report.get("prompt_kinds", [])]
    width = max([7] + [len(k) for k in kinds])
    head = f"{'method':<12} {label:<{width}} {'tok/s':>8} {'accept':>7} {'tok/fwd':>8}"
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        for kind in kinds:
            row = r["by_kind"].get(kind)
            if row is None:
                continue
            acc = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.3f}"
            lines.append(f"{r['method']:<12} {kind:<{width}} {row['tokens_per_s']:>8.1f} {acc:>7} "
                         f"{row['mean_accepted_len']:>8.2f}")
    return "\n".join(lines)


def prompt_class(kind: str) -> str:
    """The class of a chat-model suite prompt's kind (``turn1`` / ``turn2`` / ``turn3+`` are ``chat``)."""
    return "chat" if kind in TURN_KINDS else kind


def has_chat_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_messages(messages: list[tuple[str, str]], tokenizer: Any = None, template: str | None = None) -> str:
    """``messages`` then the assistant generation prompt: the tokenizer's chat template when it has
    one, else ``template`` (a `ChatTemplate` string), else the server's plain transcript."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                             add_generation_prompt=True)
    if template is not None:
        return ChatTemplate(template).render(messages)
    from specops.server.chat_template import render_plain

    return render_plain(messages, getattr(tokenizer, "eos_token", None))


def chat_model_conversations(name: str) -> list[tuple[list[tuple[str, str]], str, float]]:
    """One class of the chat-model suites as conversations: (messages up to and with the user's last
    message, the prompt's kind, its temperature). ``chat`` gives every user turn of each shipped
    conversation (kinds ``turn1`` / ``turn2`` / ``turn3+``), the other classes one user message each."""
    from specops.bench import chat_prompts

    if name == "chat":
        out = []
        for texts in chat_prompts.CONVERSATIONS:
            conversation = [("user" if i % 2 == 0 else "assistant", text) for i, text in enumerate(texts)]
            for i, (role, _) in enumerate(conversation):
                if role == "user":
                    out.append((conversation[: i + 1], turn_kind(1 + i // 2), 0.0))
        return out
    sets = {"code": (chat_prompts.CODE, 0.0), "qa": (chat_prompts.QA, 0.0),
            "creative": (chat_prompts.CREATIVE, CREATIVE_TEMPERATURE)}
    if name not in sets:
        raise ValueError(f"unknown chat-model class {name!r}; choose one of {', '.join(CHAT_MODEL_CLASSES)}")
    texts, temperature = sets[name]
    return [([("user", t)], name, temperature) for t in texts]


def chat_model_class(name: str, tokenizer: Any = None, template: str | None = None) -> list:
    """One class of the chat-model suites as `BenchPrompt`s (see the module docstring)."""
    from specops.bench.suites import BenchPrompt

    return [BenchPrompt(render_messages(messages, tokenizer, template), kind, temperature)
            for messages, kind, temperature in chat_model_conversations(name)]


def chat_model_suite(name: str, tokenizer: Any = None, template: str | None = None) -> list:
    """The chat-model suite ``name`` (one of `CHAT_MODEL_SUITES`); ``mixed`` interleaves the classes."""
    if name not in CHAT_MODEL_SUITES:
        raise ValueError(f"unknown chat-model suite {name!r}; choose one of {', '.join(CHAT_MODEL_SUITES)}")
    if name != "mixed":
        return chat_model_class(name, tokenizer, template)
    classes = [chat_model_class(c, tokenizer, template) for c in CHAT_MODEL_CLASSES]
    mixed = []
    for i in range(max(len(c) for c in classes)):
        mixed += [c[i] for c in classes if i < len(c)]
    return mixed
