"""Child processes for the tests that start them (the gloo EP workers, torchrun, examples/train_lm.py).

Each process runs in a new process group (start_new_session) with its output in a file (no pipe to
fill while another rank is waited on). ``run_ranks`` waits for all of them against one deadline; a rank still running then is
killed with its whole process group (torchrun's workers too) and the failure names it, with the tail of
its output, so a hang becomes a failure that says which rank hung instead of a stalled test run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass


@dataclass
class Finished:
    rank: int
    returncode: int | None  # None: killed at the deadline
    output: str             # stdout and stderr, interleaved

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def _tail(text: str, chars: int = 4000) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


def start_ranks(cmds: list[list[str]], env: dict | None = None, cwd=None) -> list[tuple[subprocess.Popen, object]]:
    procs = []
    for cmd in cmds:
        log = tempfile.TemporaryFile(mode="w+")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                       start_new_session=True, text=True), log))
    return procs


def wait_ranks(procs, timeout: float) -> list[Finished]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p, _ in procs):
        time.sleep(0.05)
    done = []
    for rank, (p, log) in enumerate(procs):
        rc = p.poll()
        if rc is None:  # the deadline passed: the rank and everything it started go
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        log.seek(0)
        done.append(Finished(rank, rc, log.read()))
        log.close()
    return done


def run_ranks(cmds: list[list[str]], timeout: float, what: str, env: dict | None = None, cwd=None) -> list[str]:
    """Runs one process per rank; returns their outputs when every rank exits 0 within ``timeout`` seconds,
    else fails naming each rank that hung or failed."""
    done = wait_ranks(start_ranks(cmds, env, cwd), timeout)
    bad = [d for d in done if d.returncode != 0]
    if bad:
        lines = [f"{what}: " + ", ".join(f"rank {d.rank} " + ("hung (killed after %g s)" % timeout if d.timed_out
                                                             else f"exited {d.returncode}") for d in bad)]
        for d in bad:
            lines.append(f"--- rank {d.rank} output:\n{_tail(d.output)}")
        raise AssertionError("\n".join(lines))
    return [d.output for d in done]


def run(cmd: list[str], timeout: float, what: str, env: dict | None = None, cwd=None) -> str:
    """One process (a launcher such as torchrun counts as one): its output, or a failure as run_ranks."""
    return run_ranks([cmd], timeout, what, env, cwd)[0]
