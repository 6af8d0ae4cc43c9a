"""The prompts ``specops bench serve`` sends: drawn from the mix (completion text) or from the
chat-model suites (`ChatPrompt`, conversations for ``/v1/chat/completions``), tagged fresh per
batch, and counted per class of the server's policy."""

from __future__ import annotations

import functools
import random
import secrets
from dataclasses import dataclass
from typing import Any, Union

from specops.bench.serve.config import CHAT_SUITE, MIX_KINDS, ServeBenchConfig
from specops.policies.turns import turn_from_messages


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation of the chat-model suites, sent to ``/v1/chat/completions`` as its messages
    (the server renders them with the model's chat template) with the label ``task`` = its class
    (``chat``, ``code``, ``qa``, ``creative``: how a client that knows its traffic labels it)."""

    messages: tuple[tuple[str, str], ...]
    task: str

    @property
    def turn(self) -> int:
        """The conversation's turn, as the server counts it (`turn_from_messages`)."""
        return turn_from_messages({"role": role} for role, _ in self.messages)

    @property
    def user_text(self) -> str:
        """The last user message: what the server's class rules read of a chat request."""
        return next(text for role, text in reversed(self.messages) if role == "user")

    def tagged(self, tag: str) -> ChatPrompt:
        """The conversation with ``tag`` before its first message's text (`PromptTags`)."""
        (role, text), *rest = self.messages
        return ChatPrompt(((role, tag + text), *rest), self.task)


Prompt = Union[str, ChatPrompt]
"""What one request sends: completion text, or a conversation."""


@functools.lru_cache(maxsize=1)
def _chat_pool() -> list[tuple[ChatPrompt, float]]:
    """Every prompt of the chat-model ``mixed`` suite as a conversation, with its temperature."""
    from specops.bench.chat_suite import CHAT_MODEL_CLASSES, chat_model_conversations, prompt_class

    return [(ChatPrompt(tuple(messages), prompt_class(kind)), temperature)
            for name in CHAT_MODEL_CLASSES for messages, kind, temperature in chat_model_conversations(name)]


@functools.lru_cache(maxsize=8)
def _suite_pools(seed: int) -> dict[str, list[tuple[str, float]]]:
    """The bundled suites' prompts by mix kind (parsed once: each cell draws from them)."""
    from specops.bench.suites import HOT_TEMPERATURE, builtin_suite

    return {"code": [(p.text, 0.0) for p in builtin_suite("code", seed=seed)],
            "prose": [(p.text, 0.0) for p in builtin_suite("prose", seed=seed)],
            "hot": [(p.text, HOT_TEMPERATURE) for p in builtin_suite("code", seed=seed + 1)]}


def build_prompts(cfg: ServeBenchConfig, count: int) -> list[tuple[Prompt, float]]:
    """``count`` (prompt, temperature) pairs drawn from the mix, or with ``--suite chat`` from the
    chat-model suite's prompts (the same list for every mode)."""
    from specops.bench.suites import load_prompts_file

    rng = random.Random(cfg.seed)
    if cfg.suite == CHAT_SUITE:
        chat = _chat_pool()
        return [rng.choice(chat) for _ in range(count)]
    if cfg.prompts_file:
        pool = [(p.text, p.temperature) for p in load_prompts_file(cfg.prompts_file)]
        return [pool[i % len(pool)] for i in range(count)]
    pools = _suite_pools(cfg.seed)
    kinds = [k for k in MIX_KINDS if cfg.mix.get(k, 0) > 0]
    weights = [cfg.mix[k] for k in kinds]
    return [rng.choice(pools[rng.choices(kinds, weights)[0]]) for _ in range(count)]


class PromptTags:
    """What makes each batch of traffic fresh: unless ``warm`` (``--warm-prefix``), every measured
    cell and every batch of unmeasured traffic (warm-up, settle) gets its own first line,
    ``#SERIAL-RUN`` (SERIAL counts the batches, RUN is random per bench run, so a running server's
    cache holds nothing from an earlier run). A server's prefix cache chains each block's key to
    the blocks before it, so prompts whose first block differs share no cached block: a cell finds
    none of its prompts from another repeat, mode or settle batch there, only repeats of a prompt
    within itself (the mix draws with replacement). The tag is a Python comment line; class rules
    that look at a prompt's start (``prefix``, ``^`` regexes) see it, the built-in mix's classes
    are the same with and without it. ``warm``: batches go out as drawn, the same texts each
    repeat (and settle traffic replays the cell's own prompts), so those figures are of a warm
    prefix cache."""

    def __init__(self, warm: bool, run: str | None = None) -> None:
        self.warm = warm
        self.run = run if run is not None else secrets.token_hex(3)
        self.serial = 0

    def tag(self, serial: int) -> str:
        return f"#{serial}-{self.run}\n"

    def fresh(self, prompts: list[tuple[Prompt, float]]) -> list[tuple[Prompt, float]]:
        """``prompts`` as the next batch sends them: behind a tag no batch had before (as they are when warm)."""
        if self.warm:
            return list(prompts)
        self.serial += 1
        return self._tagged(prompts, self.tag(self.serial))

    def example(self, prompts: list[tuple[Prompt, float]]) -> list[tuple[Prompt, float]]:
        """``prompts`` as a batch would send them, without using up a tag (to classify them)."""
        return list(prompts) if self.warm else self._tagged(prompts, self.tag(0))

    @staticmethod
    def _tagged(prompts: list[tuple[Prompt, float]], tag: str) -> list[tuple[Prompt, float]]:
        # a conversation carries the tag in its first message (the model's own system prompt, where its
        # template adds one, stays the same for every request, as a deployment's does)
        return [(p.tagged(tag) if isinstance(p, ChatPrompt) else tag + p, t) for p, t in prompts]


def mix_classes(policy: Any, cfg: ServeBenchConfig, counts: dict[int, int],
                tags: PromptTags | None = None) -> dict[str, dict[str, int]]:
    """How each concurrency's cell of prompts splits into ``policy``'s classes, per class in policy
    order (as `specops policy classify` counts them: completion text carries no labels or turn, a
    conversation its ``task`` label, its turn and its last user message; length rules see the text's
    characters / ``CHARS_PER_TOKEN``), the prompts as ``tags`` sends them (default: as drawn)."""
    from specops.policies.cli_classify import Sample, classify

    def sample(prompt: Prompt, temperature: float) -> Sample:
        if isinstance(prompt, ChatPrompt):  # as the server reads a chat request: its last user message
            return Sample(prompt.user_text, temperature, {"task": prompt.task}, turn=prompt.turn)
        return Sample(prompt, temperature, {})

    tags = tags or PromptTags(warm=True)
    out: dict[str, dict[str, int]] = {}
    for c, n in counts.items():
        names = [classify(policy, sample(prompt, temperature)).request_class
                 for prompt, temperature in tags.example(build_prompts(cfg, n))]
        out[str(c)] = {rc.name: names.count(rc.name) for rc in policy.classes}
    return out
