"""``specops policy classify``: which class, and which of its rules, a request lands in.

The server and the sidecar classify every request with `Policy.match`; this command runs the
same function on prompts given on the command line or in a file, so a policy's match rules can
be checked against a sample of real traffic before it is rolled out. Without a tokenizer at
hand, length rules see the sidecar's estimate of the prompt's tokens (``CHARS_PER_TOKEN``
characters each).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import click

from specops.policies.cli import _friendly
from specops.policies.loader import load_policy
from specops.policies.schema import CHARS_PER_TOKEN, MatchRule, Policy

MAX_PROMPTS = 1_000_000
"""Prompts one ``--prompts`` file may hold (a bound on the memory this command uses)."""


@dataclass(frozen=True)
class Sample:
    """One request to classify."""

    prompt: str
    temperature: float
    labels: dict[str, str]
    turn: int | None = None
    kind: str | None = None


@dataclass(frozen=True)
class Verdict:
    sample: Sample
    request_class: str
    rule: int | None  # 1-based index of the matching rule in its class; None: the default class
    speculates: bool  # the class speculates at the request's temperature (method not off, in range)

    @property
    def rule_text(self) -> str:
        return "default class" if self.rule is None else f"rule {self.rule}"


def describe_rule(rule: MatchRule) -> str:
    """The conditions a rule tests, briefly: ``regex + label``."""
    return " + ".join(rule.conditions())


def classify(policy: Policy, sample: Sample) -> Verdict:
    rc, index = policy.match(sample.prompt, sample.labels, len(sample.prompt) // CHARS_PER_TOKEN, sample.turn,
                             sample.temperature)
    return Verdict(sample, rc.name, None if index is None else index + 1, rc.speculates_at(sample.temperature))


def _parse_labels(values: tuple[str, ...]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--label")
        labels[key] = value
    return labels


def _bad(path: Path, number: int, message: str) -> click.ClickException:
    return click.ClickException(f"{path}:{number}: {message}")


def read_samples(path: Path, temperature: float, labels: dict[str, str], turn: int | None = None) -> list[Sample]:
    """``path``: JSONL rows with ``prompt`` (and optional ``temperature``, ``labels``, ``turn``,
    ``kind``), or plain text with one prompt per line. ``temperature`` / ``labels`` / ``turn``:
    what rows that do not say get (a row's labels add to ``labels``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise click.ClickException(f"prompts file not found: {path}") from None
    except UnicodeDecodeError:
        raise click.ClickException(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise click.ClickException(f"{path}: {exc.strerror or exc}") from None
    samples: list[Sample] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(samples) >= MAX_PROMPTS:
            raise click.ClickException(f"{path}: more than {MAX_PROMPTS:,} prompts")
        if path.suffix != ".jsonl":
            samples.append(Sample(line, temperature, labels, turn))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _bad(path, number, f"invalid JSON: {exc.msg}") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise _bad(path, number, "each line needs a non-empty string field 'prompt'")
        t = row.get("temperature", temperature)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 2:
            raise _bad(path, number, f"temperature must be a number in [0, 2], got {t!r}")
        row_labels = row.get("labels", {})
        if not isinstance(row_labels, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in row_labels.items()):
            raise _bad(path, number, "labels must be an object of string values")
        row_turn = row.get("turn", turn)
        if row_turn is not None and (isinstance(row_turn, bool) or not isinstance(row_turn, int) or row_turn < 1):
            raise _bad(path, number, f"turn must be an integer >= 1, got {row_turn!r}")
        kind = row.get("kind")
        samples.append(Sample(row["prompt"], float(t), {**labels, **row_labels}, row_turn,
                              None if kind is None else str(kind)))
    if not samples:
        raise click.ClickException(f"no prompts in {path}")
    return samples


def _excerpt(text: str, width: int = 48) -> str:
    flat = repr(text)[1:-1]
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _rule_column(policy: Policy, v: Verdict) -> str:
    if v.rule is None:
        return v.rule_text
    return f"{v.rule_text} ({describe_rule(policy.get_class(v.request_class).match[v.rule - 1])})"


def format_verdicts(policy: Policy, verdicts: list[Verdict]) -> list[str]:
    """One aligned line per request: class, rule (and what it tests), temperature, the prompt."""
    rules = [_rule_column(policy, v) for v in verdicts]
    width = max(len(r) for r in rules)
    names = max(len(v.request_class) for v in verdicts)
    return [f"{v.request_class:<{names}}  {rule:<{width}}  t={v.sample.temperature:<4g} {_excerpt(v.sample.prompt)}"
            + ("" if v.speculates else "  [decodes plainly at this temperature]")
            for v, rule in zip(verdicts, rules)]


def format_summary(policy: Policy, verdicts: list[Verdict]) -> str:
    """Requests per class (in policy order), their share, the kinds and rules that put them there."""
    total = len(verdicts)
    lines = [f"{'class':<12} {'requests':>8} {'share':>6}  {'plain':>5}  by kind / by rule"]
    for rc in policy.classes:
        mine = [v for v in verdicts if v.request_class == rc.name]
        if not mine:
            lines.append(f"{rc.name:<12} {0:>8} {'0%':>6}  {'-':>5}")
            continue
        kinds = Counter(v.sample.kind for v in mine if v.sample.kind is not None)
        rules = Counter(v.rule_text for v in mine)
        plain = sum(not v.speculates for v in mine)
        detail = ", ".join(f"{k} {n}" for k, n in kinds.most_common())
        detail = (detail + " / " if detail else "") + ", ".join(f"{r} {n}" for r, n in sorted(rules.items()))
        lines.append(f"{rc.name:<12} {len(mine):>8} {len(mine) / total:>6.0%}  {plain:>5}  {detail}")
    lines.append(f"{total} requests; plain: requests whose class does not speculate at their temperature "
                 f"(method off, or outside the class's temperature range)")
    return "\n".join(lines)


@click.command("classify")
@click.argument("policy_file", type=click.Path(dir_okay=False))
@click.argument("prompts", nargs=-1)
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="JSONL with 'prompt' (and 'temperature', 'labels', 'turn', 'kind') or one prompt per line: "
                   "print requests per class instead of one line per prompt.")
@click.option("--temperature", type=click.FloatRange(min=0.0, max=2.0), default=1.0, show_default=True,
              help="Sampling temperature of the requests (an OpenAI request that omits it samples at 1.0).")
@click.option("--label", "label_items", multiple=True, metavar="KEY=VALUE",
              help="A request label (metadata / x-specops-label-KEY header); repeatable.")
@click.option("--turn", type=click.IntRange(min=1), default=None, help="Conversation turn (1 = the first reply).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt (with --prompts: the counts).")
@_friendly
def classify_command(policy_file: str, prompts: tuple[str, ...], prompts_file: Path | None, temperature: float,
                     label_items: tuple[str, ...], turn: int | None, as_json: bool) -> None:
    """Which class of POLICY_FILE (and which of its match rules) each of PROMPTS lands in, as
    `specops serve` and the sidecar classify them."""
    if bool(prompts) == (prompts_file is not None):
        raise click.UsageError("give PROMPTS or --prompts FILE (one of the two)")
    policy = load_policy(Path(policy_file), filename=policy_file)
    labels = _parse_labels(label_items)
    if prompts_file is not None:
        verdicts = [classify(policy, s) for s in read_samples(prompts_file, temperature, labels, turn)]
        if as_json:
            counts = {rc.name: sum(v.request_class == rc.name for v in verdicts) for rc in policy.classes}
            click.echo(json.dumps({"requests": len(verdicts), "classes": counts}))
        else:
            click.echo(format_summary(policy, verdicts))
        return
    verdicts = [classify(policy, Sample(text, temperature, labels, turn)) for text in prompts]
    if not as_json:
        click.echo("\n".join(format_verdicts(policy, verdicts)))
        return
    for v in verdicts:
        click.echo(json.dumps({"class": v.request_class, "rule": v.rule, "speculates": v.speculates,
                               "temperature": temperature}))
