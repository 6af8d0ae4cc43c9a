"""SIGTERM to a ``specops`` command unwinds it: its ``finally`` blocks stop what it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

# a command registered in the CLI's table the way every real command is, which starts a child
# process and stops it by its PID in ``finally``, as `bench serve` does with its servers
SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    import click
    from specops import cli

    @click.command()
    def hold():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 stdout=subprocess.DEVNULL)
        try:
            print(child.pid, flush=True)
            time.sleep(120)
        finally:
            child.terminate()
            child.wait(10)
            print("stopped", flush=True)

    cli.COMMANDS[()]["hold"] = "__main__:hold"
    cli.main(["hold"])
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie its parent has not reaped yet is gone too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_sigterm_runs_a_commands_cleanup_and_exits_143():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(proc.stdout.readline())
        assert _alive(child)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=15)
        assert proc.returncode == 128 + signal.SIGTERM
        assert "stopped" in rest
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)  # stopped by the command, not left to outlive it
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_embedding_programs_sigterm_handler_is_kept():
    script = textwrap.dedent("""
        import signal
        from specops import cli
        mine = lambda *_: None
        signal.signal(signal.SIGTERM, mine)
        cli._exit_on_sigterm()
        assert signal.getsignal(signal.SIGTERM) is mine
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        cli._exit_on_sigterm()
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
