"""Two processes under torchrun (EP 2), when two GPUs are visible: dist_worker.py does the checks."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from procs import start_ranks, wait_ranks

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_under_torchrun():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for 2 processes under torchrun; {torch.cuda.device_count()} visible")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1] / "python"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(HERE / "dist_worker.py")]
    (done,) = wait_ranks(start_ranks([cmd], env), timeout=600)
    print(done.output[-20000:])
    ok = [r for r in range(2) if f"dist worker rank {r}: OK" in done.output]
    missing = [r for r in range(2) if r not in ok]
    assert done.returncode == 0 and not missing, (
        f"torchrun {'hung (killed after 600 s)' if done.timed_out else f'exited {done.returncode}'}; "
        f"ranks without OK: {missing}\n{done.output[-4000:]}")
