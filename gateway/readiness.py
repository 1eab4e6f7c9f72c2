"""The gateway's readiness: a real generation through the verify worker (and the drafter) every few seconds, and
/ready's answer from its last result and the worker's heartbeat."""

import asyncio
import time
import uuid
from dataclasses import dataclass

from gateway.verify_client import VerifyClient
from shared.channel_gateway import RequestFailed
from shared.generation_request import GenerationRequest
from shared.sampling_params import SamplingParams


@dataclass
class Probe:
    last_ok: float = 0.0
    drafted: bool = False
    detail: str = "no probe has run yet"


class ReadinessProbe:
    """Sends a 3-token request asking for drafts every interval_s (every 0.2 s until one succeeds)."""

    def __init__(self, client: VerifyClient, drafter_configured: bool, interval_s: float, ready_window_s: float):
        self.client, self.drafter_configured = client, drafter_configured
        self.interval_s, self.ready_window_s = interval_s, ready_window_s
        self.last = Probe()

    async def run(self) -> None:
        probe, client = self.last, self.client
        while True:
            await asyncio.sleep(self.interval_s if probe.last_ok else 0.2)
            if not client.alive:
                probe.detail = "the verify worker is not responding"
                continue
            request_id = f"probe-{uuid.uuid4().hex}"
            message = GenerationRequest((0,), 3, SamplingParams(seed=0), num_speculative_tokens=1,
                                        request_id=request_id)
            try:
                queue = await client.submit(message)
                while True:
                    event = await asyncio.wait_for(queue.get(), timeout=10)
                    if isinstance(event, RequestFailed):
                        probe.detail = f"probe failed: {event.message}"
                        break
                    if event.finish_reason is not None:
                        probe.last_ok, probe.drafted = time.monotonic(), event.draft_tokens > 0
                        probe.detail = "ok" if probe.drafted or not self.drafter_configured else \
                            "the drafter did not take part (unavailable): serving without speculation"
                        break
            except asyncio.TimeoutError:  # a busy worker: the probe leaves its queue rather than take a slot later
                probe.detail = "probe failed: no answer within 10 s"
                await client.abort(request_id)
            except ConnectionError as exc:
                probe.detail = f"probe failed: {exc}"
            finally:
                client.finish(request_id)

    def status(self) -> tuple[bool, dict]:
        """(ready, /ready's body): the worker alive, a recent probe answered, and the drafter up where one is
        configured."""
        probe, client = self.last, self.client
        recent = probe.last_ok and time.monotonic() - probe.last_ok < self.ready_window_s
        heartbeat = client.last_heartbeat
        drafter_up = bool(probe.drafted and heartbeat and heartbeat.drafter_available)
        ok = bool(client.alive and recent and (drafter_up or not self.drafter_configured))
        return ok, {
            "ready": ok,
            "verify_worker": "up" if client.alive else "down",
            "drafter": ("available" if heartbeat and heartbeat.drafter_available else "unavailable")
            if self.drafter_configured else "none",
            "detail": probe.detail if client.alive else "the verify worker is not responding",
            "running": heartbeat.running if heartbeat else None,
            "waiting": heartbeat.waiting if heartbeat else None,
        }
