"""Benchmark prompt suites: code, docstring prose, and a mixed set with hot sampling.

All built-in prompts come from the stdlib's held-out ``test/`` files (never seen in
training), chosen deterministically from a seed:

* ``code``  — 20 runs of whole source lines (`specops.train.data.code_prompts`);
* ``prose`` — docstrings: the opening of a long docstring, to be continued;
* ``mixed`` — code + prose at temperature 0, plus a high-temperature (1.0) set;
* ``chat``  — multi-turn conversations (first reply vs follow-ups), see `specops.bench.chat_suite`.

For a model whose tokenizer has a chat template (an instruction-tuned model, e.g.
``--model smollm2-135m-instruct``), ``chat``, ``code`` and ``mixed`` are instead the
shipped chat-model suites, rendered with that template: multi-turn chat, code requests,
factual ``qa`` and ``creative`` writing (temperature 0.8); ``mixed`` interleaves the four
classes (`specops.bench.chat_suite.chat_model_suite`). ``qa`` and ``creative`` are always
those sets (rendered with the server's plain transcript format for a model without a
template).

``--prompts FILE`` replaces them: JSONL with a ``prompt`` field (optional
``temperature`` and ``kind``) or plain text with one prompt per line.
"""

from __future__ import annotations

import ast
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

SUITES = ("code", "prose", "mixed", "chat", "qa", "creative")
HOT_TEMPERATURE = 1.0


class SuiteError(ValueError):
    """Raised for an unknown suite or an unusable prompts file."""


class _TooFewFiles(SuiteError):
    """The stdlib's held-out files gave fewer prompts than the suite needs."""


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt."""

    text: str
    kind: str = "custom"          # code | prose | hot | custom
    temperature: float = 0.0      # 0 = greedy (exactness is checked only for these)


def docstring_prompts(files: Sequence[Path], *, count: int = 10, min_chars: int = 160, max_chars: int = 400,
                      seed: int = 0) -> list[str]:
    """Openings of long docstrings from ``files``: the source line that opens the
    docstring plus the first half (at most ``max_chars``) of its text."""
    rng = random.Random(seed)
    candidates = sorted(files)
    rng.shuffle(candidates)
    found: list[str] = []
    for path in candidates:
        source = Path(path).read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
                continue
            doc = ast.get_docstring(node, clean=False)
            if not doc or len(doc) < min_chars or not node.body:
                continue
            first = node.body[0]
            lines = source.splitlines(keepends=True)
            opening = lines[first.lineno - 1]
            quote = opening.find('"""') if '"""' in opening else opening.find("'''")
            if quote < 0:
                continue
            cut = min(max_chars, len(doc) // 2)
            cut = doc.rfind(" ", 0, cut) if " " in doc[:cut] else cut
            found.append(opening[: quote + 3] + doc[:cut])
            break  # one docstring per file keeps the set varied
        if len(found) == count:
            break
    if len(found) < count:
        raise _TooFewFiles(f"only {len(found)} docstring prompts found, {count} requested")
    return found


def builtin_suite(name: str, *, seed: int = 0, code_count: int = 20, prose_count: int = 10,
                  hot_count: int = 6, chat_conversations: int = 6, chat_turns: int = 3,
                  chat_template: str | None = None, tokenizer: Any = None) -> list[BenchPrompt]:
    """The built-in suite ``name`` (one of `SUITES`); ``tokenizer``: the model's, which picks the
    chat-model suites when it has a chat template (module docstring) and renders them."""
    from specops.bench.chat_suite import CHAT_MODEL_SUITES, chat_model_suite, has_chat_template
    from specops.train.data import DataError

    if name in ("qa", "creative") or (name in CHAT_MODEL_SUITES and has_chat_template(tokenizer)):
        try:
            return chat_model_suite(name, tokenizer, chat_template)
        except ValueError as exc:  # a bad chat_template string
            raise SuiteError(str(exc)) from None
    try:
        return _builtin_suite(name, seed=seed, code_count=code_count, prose_count=prose_count, hot_count=hot_count,
                              chat_conversations=chat_conversations, chat_turns=chat_turns, chat_template=chat_template)
    except (DataError, _TooFewFiles) as exc:
        raise SuiteError(f"{exc}: this Python's stdlib test/ folder is missing or partial (Debian and Ubuntu ship "
                         f"it apart, as libpython3.X-testsuite); write the suite where it is whole with "
                         f"`python -m specops.bench.suites --suite {name} --out prompts.jsonl` and pass "
                         f"--prompts prompts.jsonl") from None


def _builtin_suite(name: str, *, seed: int, code_count: int, prose_count: int, hot_count: int,
                   chat_conversations: int, chat_turns: int, chat_template: str | None) -> list[BenchPrompt]:
    from specops.train.data import code_prompts, heldout_files

    if name not in SUITES:
        raise SuiteError(f"unknown suite {name!r}; choose one of {', '.join(SUITES)}")
    files = list(heldout_files())
    if not files:
        raise _TooFewFiles("no held-out stdlib test files found")
    if name == "code":
        return [BenchPrompt(t, "code") for t in code_prompts(files, count=code_count, seed=seed)]
    if name == "prose":
        return [BenchPrompt(t, "prose") for t in docstring_prompts(files, count=prose_count, seed=seed)]
    if name == "chat":
        return chat_suite(files, conversations=chat_conversations, turns=chat_turns, seed=seed, template=chat_template)
    code = code_prompts(files, count=code_count // 2 + hot_count, seed=seed)
    prompts = [BenchPrompt(t, "code") for t in code[: code_count // 2]]
    prompts += [BenchPrompt(t, "prose") for t in docstring_prompts(files, count=prose_count // 2 + 1, seed=seed)]
    prompts += [BenchPrompt(t, "hot", HOT_TEMPERATURE) for t in code[code_count // 2:]]
    return prompts


def chat_suite(files: Sequence[Path], *, conversations: int = 6, turns: int = 3, seed: int = 0,
               template: str | None = None) -> list[BenchPrompt]:
    """Multi-turn chat prompts (kind ``turn1`` / ``turn2`` / ``turn3+``) rendered from
    `chat_suite_conversations` with a chat template."""
    from specops.bench.chat_suite import DEFAULT_CHAT_TEMPLATE, ChatTemplate, turn_kind, turn_prompts

    try:
        tmpl = ChatTemplate(template if template is not None else DEFAULT_CHAT_TEMPLATE)
    except ValueError as exc:
        raise SuiteError(str(exc)) from None
    prompts = []
    for conversation in chat_suite_conversations(files, conversations=conversations, turns=turns, seed=seed):
        prompts += [BenchPrompt(text, turn_kind(turn)) for turn, text in turn_prompts(conversation, tmpl)]
    return prompts


def chat_suite_conversations(files: Sequence[Path], *, conversations: int = 6, turns: int = 3,
                             seed: int = 0) -> list[list[tuple[str, str]]]:
    """The chat suite's conversations as ``[(role, content), ...]`` ending with a user
    message: half from held-out code, half from docstrings, short messages (<= 240 chars)."""
    from specops.bench.chat_suite import chat_conversations
    from specops.train.data import code_prompts

    if conversations < 1 or turns < 1:
        raise SuiteError(f"chat suite needs conversations >= 1 and turns >= 1, got {conversations}, {turns}")
    size = 2 * turns - 1
    n_code = (conversations + 1) // 2
    snippets = code_prompts(files, count=n_code * size, max_chars=240, seed=seed)
    convs = chat_conversations(snippets, turns=turns)
    if conversations - n_code:
        docs = docstring_prompts(files, count=(conversations - n_code) * size, min_chars=120, max_chars=240, seed=seed)
        convs += chat_conversations(docs, turns=turns)
    return convs


def load_prompts_file(path: str | Path) -> list[BenchPrompt]:
    """Prompts from a ``.jsonl`` file (``prompt`` field, optional ``temperature``,
    ``kind``) or a text file (one prompt per line, blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise SuiteError(f"prompts file not found: {path}")
    lines = path.read_text(encoding="utf-8").splitlines()
    prompts: list[BenchPrompt] = []
    if path.suffix == ".jsonl":
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SuiteError(f"{path}:{number}: invalid JSON: {exc.msg}") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise SuiteError(f"{path}:{number}: each line needs a non-empty string field 'prompt'")
            temperature = row.get("temperature", 0.0)
            if not isinstance(temperature, (int, float)) or temperature < 0:
                raise SuiteError(f"{path}:{number}: temperature must be a number >= 0, got {temperature!r}")
            prompts.append(BenchPrompt(row["prompt"], str(row.get("kind", "custom")), float(temperature)))
    else:
        prompts = [BenchPrompt(line, "custom") for line in lines if line.strip()]
    if not prompts:
        raise SuiteError(f"no prompts in {path}")
    return prompts


def write_prompts_file(prompts: Sequence[BenchPrompt], path: str | Path) -> None:
    """``prompts`` as the JSONL that `load_prompts_file` reads back (text, kind, temperature)."""
    rows = [json.dumps({"prompt": p.text, "kind": p.kind, "temperature": p.temperature}) for p in prompts]
    Path(path).write_text("\n".join(rows) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specops.bench.suites --suite mixed --out prompts.jsonl``: a built-in suite as
    a prompts file, for `specops bench decode --prompts` on a machine without the stdlib tests."""
    import argparse

    parser = argparse.ArgumentParser(description="Write a built-in bench suite as a prompts file (JSONL) "
                                                 "for `specops bench decode --prompts`.")
    parser.add_argument("--suite", choices=[s for s in SUITES if s != "chat"], default="code")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        prompts = builtin_suite(args.suite, seed=args.seed)
    except SuiteError as exc:
        parser.exit(2, f"error: {exc}\n")
    write_prompts_file(prompts, args.out)
    print(f"wrote {len(prompts)} {args.suite} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
