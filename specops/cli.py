"""The ``specops`` command line: a thin click tree.

Each command lives in the module that owns its feature and is imported only when
invoked, so ``specops policy ...`` never imports torch. Options may also be given
as environment variables with the ``SPECOPS_`` prefix (``SPECOPS_REDIS`` for
``--redis``, ...).
"""

from __future__ import annotations

import importlib
import signal
import threading

import click

# group path -> {command name -> "module:attribute"}; the attribute is a click command.
COMMANDS: dict[tuple[str, ...], dict[str, str]] = {
    (): {
        "demo": "specops.demo:demo_command",
        "serve": "specops.server.cli:serve_command",
        "sidecar": "specops.sidecar.cli:sidecar_command",
        "engine-config": "specops.sidecar.cli:engine_config_command",
        "simulate": "specops.controller.cli:simulate_command",
        "chaos": "specops.chaos.cli:chaos_command",
    },
    ("train",): {
        "tiny": "specops.train.cli:train_tiny_command",
        "draft": "specops.train.cli:train_draft_command",
        "heads": "specops.train.cli_heads:train_heads_command",
        "eagle": "specops.train.cli_eagle:train_eagle_command",
        "ngram-store": "specops.train.cli_store:train_store_command",
    },
    ("bench",): {
        "decode": "specops.bench.cli:bench_decode_command",
        "kernels": "specops.kernels.bench:bench_kernels_command",
        "medusa": "specops.bench.medusa_sweep:bench_medusa_command",
        "serve": "specops.bench.serve:bench_serve_command",
        "turns": "specops.bench.serve_turns:bench_turns_command",
        "sidecar": "specops.bench.sidecar_overhead:bench_sidecar_command",
        "speedup-truth": "specops.bench.speedup_truth:bench_speedup_truth_command",
    },
    ("policy",): {
        "validate": "specops.policies.cli:validate_command",
        "diff": "specops.policies.cli:diff_command",
        "rollout": "specops.policies.cli:rollout_command",
        "promote": "specops.policies.cli:promote_command",
        "abort": "specops.policies.cli:abort_command",
        "rollback": "specops.policies.cli:rollback_command",
        "status": "specops.policies.cli:status_command",
        "history": "specops.policies.cli:history_command",
        "migrate-keys": "specops.policies.cli:migrate_keys_command",
        "decisions": "specops.policies.cli_decisions:decisions_command",
        "classify": "specops.policies.cli_classify:classify_command",
    },
    ("models",): {
        "list": "specops.models.cli:list_command",
        "pull": "specops.models.cli:pull_command",
    },
    ("controller",): {
        "run": "specops.controller.cli:run_command",
    },
    ("alerts",): {
        "render": "specops.alerts.cli:render_command",
    },
    ("dashboard",): {
        "snapshot": "specops.alerts.cli:snapshot_command",
        "check": "specops.alerts.cli:check_command",
    },
}

GROUP_HELP = {
    ("train",): "Train the bundled models, distil drafts, train Medusa and EAGLE heads, count n-gram stores.",
    ("bench",): "Benchmarks: decoding methods vs peers, kernels, serving, chat turns, the sidecar's overhead.",
    ("models",): "Real pretrained models: list the registered ones, pull one into the cache (--model NAME).",
    ("policy",): "Validate and roll out YAML speculation policies.",
    ("controller",): "The adaptive control loop (fleet controller; the per-pod proxy is `specops sidecar`).",
    ("alerts",): "Render alert rules for Prometheus and Grafana.",
    ("dashboard",): "The Grafana dashboard's queries against a live Prometheus: check them, render a PNG.",
}


class LazyGroup(click.Group):
    """A click group whose sub-commands are imported on first use."""

    def __init__(self, *args, path: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.path = path

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = set(COMMANDS.get(self.path, {}))
        names |= {p[len(self.path)] for p in COMMANDS if len(p) == len(self.path) + 1 and p[: len(self.path)] == self.path}
        return sorted(names)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        sub = self.path + (name,)
        if sub in COMMANDS:
            return LazyGroup(name=name, path=sub, help=GROUP_HELP.get(sub))
        target = COMMANDS.get(self.path, {}).get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
                reason = f"not available in this install ({module_name} missing)"
            else:
                reason = f"needs the Python package '{exc.name}': install specops[runtime] (after torch)"
            return _unavailable(name, reason)
        return getattr(module, attr)


def _unavailable(name: str, reason: str) -> click.Command:
    """A command that only explains why it cannot run (keeps ``--help`` working)."""

    def fail() -> None:
        raise click.ClickException(f"command '{name}' is {reason}" if reason.startswith("not") else f"command '{name}' {reason}")

    return click.Command(name, callback=fail, help=f"[unavailable: {reason}]")


@click.group(cls=LazyGroup, context_settings={"auto_envvar_prefix": "SPECOPS", "help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specops")
def main() -> None:
    """specops: fast and safe speculative decoding."""
    _exit_on_sigterm()


def _exit_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C: a command stopped by its supervisor (``kill``, a container
    runtime, a CI timeout) runs its ``finally`` blocks, so the servers, controllers and Redis it
    started are stopped by their PIDs instead of outliving it. Exits 143 (128 + SIGTERM), as the
    signal's default action reports to a shell. Commands that serve until a signal install their
    own handler while they serve (`specops.webstack.serve_until_signal`, the controller)."""
    if threading.current_thread() is not threading.main_thread():
        return  # signals can only be handled in the main thread (a test runner calling main())
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # an embedding program's own handler stays

    def leave(signum: int, frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


if __name__ == "__main__":  # pragma: no cover
    main()
