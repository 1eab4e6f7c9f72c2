"""Liveness of the verify worker, independent of how long a step takes.

The gateway takes a verify worker that stays silent for its limit (2 s) for dead. Heartbeats therefore come
from their own thread, every interval, whatever the loop is doing: waiting for a drafter, prefilling a long
prompt, compiling on a first GPU step. What the thread cannot tell apart from a long step is a loop that is
stuck for good (a deadlock); so it also watches the loop's progress, and a loop that has not come round for
stall_s (far longer than any wait the loop bounds itself) is declared hung: `on_stall` runs once and the
heartbeats stop. A loop stuck while holding the GIL stops this thread too (so the gateway, hearing nothing,
fails its requests after its silence limit); for that case faulthandler's C watchdog, re-armed at every
progress, dumps every thread's stack and exits the process BACKSTOP_S after the stall limit.
"""

import faulthandler
import logging
import threading
import time
from typing import Callable

from shared.channel_gateway import Heartbeat

BACKSTOP_S = 5.0  # after stall_s: time for on_stall to run first when the GIL is free
REARM_S = 1.0  # the watchdog is re-armed at most this often


class HeartbeatThread:
    def __init__(self, send: Callable[[Heartbeat], None], interval_s: float, stall_s: float,
                 on_stall: Callable[[float], None], log: logging.Logger):
        self.send, self.interval_s, self.stall_s, self.on_stall, self.log = send, interval_s, stall_s, on_stall, log
        self.latest: Heartbeat | None = None
        self.last_progress = time.monotonic()
        self.armed_at = float("-inf")
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """No heartbeat is sent after this returns (unless called from the thread itself)."""
        self.stopped.set()
        if self.stall_s:
            faulthandler.cancel_dump_traceback_later()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join()

    def progress(self, heartbeat: Heartbeat) -> None:
        """Called by the loop each time round: it is alive, and this is what it reports."""
        now = time.monotonic()
        self.latest, self.last_progress = heartbeat, now
        if self.stall_s and not self.stopped.is_set() and now - self.armed_at >= REARM_S:
            faulthandler.dump_traceback_later(self.stall_s + BACKSTOP_S, exit=True)  # 30 us: not every loop
            self.armed_at = now

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            silent = time.monotonic() - self.last_progress
            if self.stall_s and silent > self.stall_s:
                self.log.error("the verify loop made no progress for %.0f s: it is hung", silent)
                self.on_stall(silent)
                return
            if self.latest is not None:
                self.send(self.latest)
