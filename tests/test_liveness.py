"""The verify worker's heartbeat thread: heartbeats while the loop is busy, and a hung loop is ended, also
when it holds the GIL (then no Python thread runs, and faulthandler's watchdog ends the process)."""

import subprocess
import sys
import textwrap
import time

from shared.channel_gateway import Heartbeat
from verify_worker import liveness
from verify_worker.liveness import HeartbeatThread


def beat() -> Heartbeat:
    return Heartbeat(running=1, waiting=0, drafter_kind="dflash", drafter_available=True)


def test_heartbeats_flow_while_the_loop_is_busy_and_a_stalled_loop_is_reported():
    sent, stalls = [], []
    thread = HeartbeatThread(sent.append, 0.05, 0.6, stalls.append, liveness.logging.getLogger("test"))
    thread.progress(beat())
    thread.start()
    time.sleep(0.4)  # a long step: the loop does not come round, yet heartbeats go out
    assert len(sent) >= 5 and not stalls
    time.sleep(0.6)  # no progress past the stall limit: reported once, heartbeats stop
    assert len(stalls) == 1 and stalls[0] > 0.6
    count = len(sent)
    time.sleep(0.2)
    assert len(sent) == count
    thread.stop()


def test_a_loop_hung_holding_the_gil_ends_the_process():
    """A catastrophic regex holds the GIL in C: the Python watchdog cannot run, faulthandler's can."""
    script = textwrap.dedent("""
        import logging, re
        from shared.channel_gateway import Heartbeat
        from verify_worker import liveness
        liveness.BACKSTOP_S = 0.5
        thread = liveness.HeartbeatThread(lambda m: None, 0.05, 0.5, lambda s: None, logging.getLogger("x"))
        thread.progress(Heartbeat(running=0, waiting=0, drafter_kind="none", drafter_available=False))
        thread.start()
        re.match(r"(a+)+$", "a" * 40 + "b")  # holds the GIL for far longer than the test
    """)
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and time.monotonic() - began < 20
    assert "Timeout" in result.stderr and "line 10" in result.stderr  # the dump shows where it hung
