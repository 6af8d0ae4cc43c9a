"""``specops bench serve --model NAME|PATH``: the started servers serve that target alone.

A real model comes with no draft model and no Medusa heads, so the policy the started
server would run (``--server-arg --policy FILE``, else ``specops serve``'s default,
examples/policies/default.yaml) is rewritten with the same classes, match rules, alerts
and rollout, each class on a method that server has (`specops.policies.retarget`: a class
on a draft model or Medusa heads moves to ``eagle`` where an EAGLE drafter is at hand — the
one ``specops train eagle --model NAME`` cached, or ``--server-arg --eagle DIR`` — and the
class is sampled or on Medusa heads, else to ``ngram``; ``off``, ``auto`` and ``ngram`` stay).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specops.bench.serve.config import BenchServeError

NGRAM = "ngram"
EAGLE = "eagle"


def _flag_value(args: list[str], flag: str) -> tuple[str | None, list[str]]:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``; the last one given, as click
    reads it) and ``args`` without it."""
    value, rest, i = None, [], 0
    while i < len(args):
        if args[i] == flag and i + 1 < len(args):
            value, i = args[i + 1], i + 2
            continue
        if args[i].startswith(flag + "="):
            value = args[i].split("=", 1)[1]
        else:
            rest.append(args[i])
        i += 1
    return value, rest


def lone_target_policy(text: str, drafter: bool) -> tuple[str, dict[str, str]]:
    """Policy YAML ``text`` rewritten for a target served alone (`specops.policies.retarget`):
    the new YAML and each class's method. ``drafter``: the server loads an EAGLE drafter."""
    from specops.policies import PolicyError
    from specops.policies.retarget import retarget_policy

    try:
        return retarget_policy(text, [EAGLE] if drafter else [])
    except PolicyError as exc:
        raise BenchServeError(f"the policy to serve --model with is not valid: {exc}") from None


def cached_drafter(ref: str, folder: Path) -> tuple[Path | None, str | None]:
    """(the EAGLE drafter cached for the registered model ``ref`` names or whose cached folder
    ``folder`` is, or None; that registered name, or None for another folder)."""
    from specops.models.eagle_io import default_dir, is_drafter_dir
    from specops.models.registry import REGISTRY, model_dir
    from specops.models.resolve import is_registered

    name = ref if is_registered(ref) else None
    if name is None:
        here = folder.resolve()
        name = next((n for n in sorted(REGISTRY) if model_dir(n).resolve() in (here, here.parent)), None)
    if name is None:
        return None, None
    cached = default_dir(name)
    return (cached if is_drafter_dir(cached) else None), name


@dataclass
class LoneTarget:
    """What ``--model`` starts: the target's folder, the drafter, the written policy and why."""
    model: str                 # as given to --model
    folder: Path
    eagle: Path | None
    policy_file: Path
    base_policy: str           # the file it was written from
    methods: dict[str, str]    # class -> method
    note: str                  # the one line saying which methods and why

    def server_args(self, user_args: list[str]) -> list[str]:
        """The started servers' arguments: the target, the written policy, the drafter, then the
        user's ``--server-arg``s but their ``--policy`` (rewritten into ours)."""
        _, rest = _flag_value(user_args, "--policy")
        eagle = ["--eagle", str(self.eagle)] if self.eagle and _flag_value(rest, "--eagle")[0] is None else []
        return ["--model", str(self.folder), "--policy", str(self.policy_file), *eagle, *rest]

    def report(self) -> dict[str, Any]:
        return {"name": self.model, "folder": str(self.folder), "eagle": str(self.eagle) if self.eagle else None,
                "base_policy": self.base_policy, "methods": dict(self.methods), "note": self.note}


CHAT_MODEL_POLICY = "chat-model.yaml"
"""The policy ``--suite chat`` serves a lone target with unless given one (examples/policies/)."""


def prepare_lone_target(ref: str, user_args: list[str], workdir: Path, progress: bool = True,
                        chat: bool = False) -> LoneTarget:
    """Resolve ``--model`` (a registered name is pulled now when not cached, its progress on stderr),
    find its drafter and write the policy into ``workdir``. ``chat`` (``--suite chat``): the policy
    to rewrite is `CHAT_MODEL_POLICY` unless the user gives one."""
    from specops.models import ModelsError
    from specops.models.registry import REGISTRY
    from specops.models.resolve import resolve_model
    from specops.server.server import DEFAULT_POLICY

    try:
        folder = Path(resolve_model(ref, progress=progress))
    except ModelsError as exc:
        raise BenchServeError(f"--model {ref}: {exc}") from None
    if not folder.is_dir():
        raise BenchServeError(f"--model {ref!r} is neither a folder nor a registered model "
                              f"({', '.join(sorted(REGISTRY))}; `specops models list`)")
    folder = folder.resolve()  # the servers run in scratch folders
    default = DEFAULT_POLICY.with_name(CHAT_MODEL_POLICY) if chat else DEFAULT_POLICY
    base = _flag_value(user_args, "--policy")[0] or str(default)
    try:
        text = Path(base).read_text()
    except OSError as exc:
        raise BenchServeError(f"cannot read the policy {base}: {exc.strerror or exc}") from None
    given = _flag_value(user_args, "--eagle")[0]
    drafter, name = (Path(given), None) if given else cached_drafter(ref, folder)
    yaml_text, methods = lone_target_policy(text, drafter is not None)
    path = workdir / "model-policy.yaml"
    path.write_text(yaml_text)
    uses = sorted(set(methods.values()), key=[NGRAM, EAGLE, "auto", "off"].index)
    listing = ", ".join(f"{c} {m}" for c, m in methods.items())
    if EAGLE in methods.values() and "auto" in methods.values():
        why = f"EAGLE drafter {drafter}: eagle for the classes on it, auto to pick between ngram and eagle"
    elif EAGLE in methods.values():
        why = (f"EAGLE drafter {drafter}: eagle for the sampled classes and those {Path(base).name} gives Medusa "
               "heads, where n-gram has little to copy; ngram for greedy code and prose")
    elif drafter is not None and "auto" in methods.values():
        why = f"EAGLE drafter {drafter} loaded for auto to pick between ngram and eagle"
    elif drafter is not None:
        why = f"EAGLE drafter {drafter} not loaded: no class of {Path(base).name} is sampled or on Medusa heads"
        drafter = None  # nothing would run it
    elif name is not None:
        why = f"no EAGLE drafter cached for {name}: `specops train eagle --model {name}`"
    else:
        why = (f"no EAGLE drafter for the folder {folder}: `specops train eagle --model {folder} --out DIR`, "
               "then --server-arg=--eagle --server-arg=DIR")
    note = (f"--model {ref}: served alone with {Path(base).name}'s classes on {' / '.join(uses)} "
            f"({listing}); {why}")
    return LoneTarget(model=ref, folder=folder, eagle=drafter, policy_file=path, base_policy=base, methods=methods,
                      note=note)
