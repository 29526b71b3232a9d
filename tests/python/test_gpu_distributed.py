"""Two processes under torchrun (EP 2), when two GPUs are visible: dist_worker.py does the checks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(out.stdout[-20000:])
    print(out.stderr[-20000:], file=sys.stderr)
    assert out.returncode == 0, f"torchrun exited {out.returncode}:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    assert out.stdout.count("OK") == 2
