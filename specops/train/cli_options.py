"""Click options shared by the training commands that write the target's own replies
(``specops train eagle`` and ``specops train heads --chat``)."""

from __future__ import annotations

from typing import Callable

import click


def reply_data_options(tokens_help: str, scope: str = "") -> Callable:
    """``--tokens``, ``--self-prompts`` and ``--batch`` (parameter ``max_batch``): how much of the
    target's own text to collect, how many user messages it writes itself, and how many replies
    the serving engine writes side by side. ``tokens_help``: what ``--tokens`` counts for this
    command; ``scope`` prefixes each help text (e.g. ``"--chat: "`` where the options apply to one
    mode only)."""
    options = (
        click.option("--tokens", type=click.IntRange(1), default=400_000, show_default=True,
                     help=scope + tokens_help),
        click.option("--self-prompts", type=click.IntRange(0), default=1000, show_default=True,
                     help=f"{scope}User messages the target writes itself as extra prompts (chat models; "
                          "0: the shipped prompts only)."),
        click.option("--batch", "max_batch", type=click.IntRange(1, 256), default=64, show_default=True,
                     help=f"{scope}Replies the serving engine writes side by side while collecting."),
    )

    def apply(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return apply
