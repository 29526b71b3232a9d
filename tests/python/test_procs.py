"""procs.py, the helper of the tests that start processes: a hang or a failure names the rank."""

from __future__ import annotations

import sys
import time

import pytest

from procs import run, run_ranks


def test_outputs_come_back_in_rank_order():
    outs = run_ranks([[sys.executable, "-c", f"print('rank {r}')"] for r in range(2)], timeout=60, what="echo")
    assert [o.strip() for o in outs] == ["rank 0", "rank 1"]


def test_a_hung_rank_is_killed_and_named():
    t0 = time.monotonic()
    cmds = [[sys.executable, "-c", "print('done')"],
            [sys.executable, "-c", "import time; print('waiting', flush=True); time.sleep(600)"]]
    with pytest.raises(AssertionError) as e:
        run_ranks(cmds, timeout=2, what="two ranks")
    assert time.monotonic() - t0 < 60
    msg = str(e.value)
    assert "two ranks: rank 1 hung (killed after 2 s)" in msg and "rank 0" not in msg.splitlines()[0]
    assert "waiting" in msg  # its output so far


def test_a_failing_process_is_named_with_its_exit_status_and_output():
    with pytest.raises(AssertionError, match=r"(?s)script: rank 0 exited 3.*boom"):
        run([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], timeout=60, what="script")
