"""Load a YAML policy into a :class:`Policy`, reporting every problem with its line.

The YAML is parsed twice over the same node tree: once into plain Python data for
pydantic, once into a map from field path to source line (from the YAML node
marks). Each pydantic error location is then mapped to the line of the deepest
existing node on its path, giving ``FILE:LINE: path.to.field: what is wrong``.
"""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from specops.policies.errors import PolicyError, PolicyIssue
from specops.policies.schema import ISSUES_CONTEXT_KEY, Policy

Loc = tuple[str | int, ...]

MAX_POLICY_BYTES = 1_000_000
MAX_DEPTH = 32
STR_TAG = "tag:yaml.org,2002:str"
MAX_NODES = 50_000
MAX_ISSUES = 50
"""At most this many problems are reported for one document (then one line counting the rest)."""


def load_policy(source: str | os.PathLike[str], *, filename: str | None = None) -> Policy:
    """Parse and validate a policy from a file path or from YAML text.

    ``source`` is read as a file when it is a ``Path`` or a string naming an existing
    file (a string containing a newline is always YAML text). Raises
    :class:`PolicyError` listing every problem found.
    """
    text, name = read_source(source, filename)
    return parse_policy(text, name)


def _is_file(text: str) -> bool:
    """Whether one-line ``text`` names an existing file (a name the OS cannot take is YAML, not a path)."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # e.g. ENAMETOOLONG, or an embedded NUL byte
        return False


def read_source(source: str | os.PathLike[str], filename: str | None = None) -> tuple[str, str]:
    """(text, display name) of a policy given as a path or as YAML text."""
    is_path = isinstance(source, os.PathLike) or (
        isinstance(source, str) and "\n" not in source and len(source) < 4096 and _is_file(source))
    if not is_path:
        if not isinstance(source, str):
            raise TypeError(f"policy source must be a path or YAML text, not {type(source).__name__}")
        return source, filename or "<string>"
    path = Path(source)
    name = filename or str(source)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PolicyError([PolicyIssue(name, 0, "<root>", f"cannot read file: {exc.strerror or exc}")]) from None
    try:
        return raw.decode("utf-8"), name
    except UnicodeDecodeError as exc:
        raise PolicyError([PolicyIssue(name, 0, "<root>", f"not UTF-8 text: {exc.reason} at byte {exc.start}")]) from None


def parse_policy(text: str, filename: str = "<string>") -> Policy:
    """Validate YAML ``text``; raise :class:`PolicyError` with every issue found."""
    if len(text.encode("utf-8", errors="replace")) > MAX_POLICY_BYTES:
        raise PolicyError([PolicyIssue(filename, 1, "<root>", f"policy larger than {MAX_POLICY_BYTES} bytes")])
    data, lines, issues = _parse_yaml(text, filename)
    if issues:
        raise PolicyError(issues)
    if not isinstance(data, dict):
        kind = "empty document" if data is None else f"a {type(data).__name__}"
        raise PolicyError([PolicyIssue(filename, lines.get((), 1), "<root>", f"a policy must be a mapping, got {kind}")])
    cross: list[tuple[Loc, str]] = []
    try:
        policy = Policy.model_validate(data, context={ISSUES_CONTEXT_KEY: cross})
    except ValidationError as exc:
        raise PolicyError(cap_issues(_issues_from_pydantic(exc, lines, filename))) from None
    except RecursionError:
        raise PolicyError([PolicyIssue(filename, 1, "<root>", "document nests too deeply")]) from None
    if cross:
        found = [PolicyIssue(filename, line_of(lines, loc), format_path(loc), msg) for loc, msg in cross]
        raise PolicyError(cap_issues(sorted(found, key=lambda i: (i.line, i.path))))
    return policy


def _parse_yaml(text: str, filename: str) -> tuple[Any, dict[Loc, int], list[PolicyIssue]]:
    """(data, path -> line map, issues) for one YAML document."""
    try:
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as exc:
        line = text[: max(0, exc.position)].count("\n") + 1
        return None, {}, [PolicyIssue(filename, line, "<root>", f"character #x{exc.character:04x} is not allowed in YAML")]
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {(): 1}, []
        lines: dict[Loc, int] = {}
        issues: list[PolicyIssue] = []
        budget = [MAX_NODES]
        _index_node(node, (), lines, issues, filename, budget, ancestors=set())
        if issues:
            return None, lines, cap_issues(issues)
        data = loader.construct_document(node)
        return data, lines, []
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        what = " ".join(p for p in (exc.context, exc.problem) if p) or "invalid YAML"
        return None, {}, [PolicyIssue(filename, line, "<root>", f"YAML syntax: {what}")]
    except yaml.YAMLError as exc:
        return None, {}, [PolicyIssue(filename, 1, "<root>", f"YAML error: {exc}")]
    except RecursionError:
        return None, {}, [PolicyIssue(filename, 1, "<root>", "document nests too deeply")]
    finally:
        loader.dispose()


def cap_issues(issues: list[PolicyIssue], limit: int = MAX_ISSUES) -> list[PolicyIssue]:
    """One issue per cause (same line and message), at most ``limit`` of them plus one that counts the rest."""
    seen: set[tuple[int, str]] = set()
    unique: list[PolicyIssue] = []
    for issue in issues:
        cause = (issue.line, issue.message)
        if cause not in seen:
            seen.add(cause)
            unique.append(issue)
    if len(unique) <= limit:
        return unique
    rest = len(unique) - limit
    last = unique[limit - 1]
    return unique[:limit] + [PolicyIssue(last.file, last.line, "<root>", f"{rest} more problems not shown")]


def _index_node(node: yaml.Node, loc: Loc, lines: dict[Loc, int], issues: list[PolicyIssue], filename: str,
                budget: list[int], depth: int = 0, *, ancestors: set[int]) -> None:
    """Record the line of every mapping key / sequence item; flag duplicate keys, deep nesting,
    self-referencing aliases and alias bombs (a budget of nodes visited, aliases counted each
    time they are used). Each of the last three stops the walk: one cause, one issue."""
    lines[loc] = node.start_mark.line + 1
    budget[0] -= 1
    if budget[0] < 0:
        return  # reported once, when the budget ran out
    if id(node) in ancestors:
        issues.append(PolicyIssue(filename, lines[loc], format_path(loc),
                                  "YAML alias refers to a node that contains it (a recursive document)"))
        budget[0] = -1  # stop the walk: the same cycle would be reported at every repetition
        return
    if depth > MAX_DEPTH:
        issues.append(PolicyIssue(filename, lines[loc], format_path(loc), "document nests too deeply"))
        budget[0] = -1
        return
    if budget[0] == 0:
        issues.append(PolicyIssue(filename, lines[loc], format_path(loc), f"document has more than {MAX_NODES} nodes"))
        budget[0] = -1
        return
    ancestors = ancestors | {id(node)}
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                issues.append(PolicyIssue(filename, key_node.start_mark.line + 1, format_path(loc),
                                          "mapping keys must be plain text"))
                continue
            key = key_node.value
            if key_node.tag != STR_TAG and key != "<<":
                issues.append(PolicyIssue(filename, key_node.start_mark.line + 1, format_path(loc),
                                          f"mapping key {key!r} must be text (quote it)"))
                continue
            if key == "<<":
                issues.append(PolicyIssue(filename, key_node.start_mark.line + 1, format_path(loc),
                                          "YAML merge keys (<<) are not supported in policies"))
                continue
            if key in seen:
                issues.append(PolicyIssue(filename, key_node.start_mark.line + 1, format_path(loc + (key,)),
                                          f"duplicate key {key!r}"))
                continue
            seen.add(key)
            lines[loc + (key,)] = key_node.start_mark.line + 1
            _index_node(value_node, loc + (key,), lines, issues, filename, budget, depth + 1, ancestors=ancestors)
            # The key's line is more useful than the value's (they differ for nested blocks).
            lines[loc + (key,)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index_node(item, loc + (i,), lines, issues, filename, budget, depth + 1, ancestors=ancestors)


def line_of(lines: dict[Loc, int], loc: Loc) -> int:
    """Line of the deepest node on ``loc`` that exists in the document."""
    for end in range(len(loc), -1, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return 1


def format_path(loc: Loc) -> str:
    """``("classes", 0, "gamma")`` -> ``classes[0].gamma``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def _issues_from_pydantic(exc: ValidationError, lines: dict[Loc, int], filename: str) -> list[PolicyIssue]:
    issues: list[PolicyIssue] = []
    for err in exc.errors(include_url=False):
        loc = _clean_loc(err["loc"], lines)
        message = _message(err)
        if err["type"] == "extra_forbidden" and loc and isinstance(loc[-1], str):
            message = _unknown_field_message(loc)
        issues.append(PolicyIssue(filename, line_of(lines, loc), format_path(loc), message))
    issues.sort(key=lambda i: (i.line, i.path))
    return issues


def _clean_loc(raw: tuple[Any, ...], lines: dict[Loc, int]) -> Loc:
    """Drop pydantic's internal location parts (union/function tags) that are not document keys."""
    loc: list[str | int] = []
    for part in raw:
        candidate = tuple(loc) + (part,)
        if isinstance(part, int) or candidate in lines or _is_field_name(part):
            loc.append(part)
    return tuple(loc)


def _is_field_name(part: Any) -> bool:
    return isinstance(part, str) and part.isidentifier() and not part.startswith(("function-", "json-"))


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The schema model that holds the field at ``loc`` (walking lists and optionals)."""
    model: Any = Policy
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        model = model.model_fields[part].annotation
        while typing.get_args(model) and not (isinstance(model, type) and issubclass(model, BaseModel)):
            inner = [a for a in typing.get_args(model) if isinstance(a, type) and issubclass(a, BaseModel)]
            if not inner:
                return None
            model = inner[0]
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unknown_field_message(loc: Loc) -> str:
    model = _model_at(loc)
    if model is None:
        return "unknown field"
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown field ({hint}allowed: {', '.join(allowed)})"


def _message(err: dict[str, Any]) -> str:
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        return msg[len("Value error, "):]
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{msg[0].lower()}{msg[1:]} (got {shown})"
