"""Fault isolation: a step that raises is undone (`RequestSnapshot`) and its requests are stepped again in halves,
recursively, so that only a request that fails a step on its own is failed; every other request advances by
exactly one step, each half being an ordinary step for its requests. A device error is the worker's fault."""

import heapq

import torch

from shared.errors import WorkerFault
from verify_worker.request import Status, StepEvent
from verify_worker.request_snapshot import RequestSnapshot


class Isolation:
    """The engine's fault isolation (a part of SpeculativeEngine)."""

    def _step_groups(self, groups: list[list[str]], events: list[StepEvent]) -> None:
        while groups:
            group = groups.pop()
            saved = self._save(group)
            try:
                events += self._step_group(set(group))
                self.last_reports.append(self.last_report)
            except WorkerFault:
                raise
            except Exception as exc:  # noqa: BLE001 - any fault of a step is looked for in its requests
                self._restore(saved)
                self._check_device(exc)
                self._drop_pending(saved)
                if len(group) == 1:
                    events.append(self._fail(group[0], exc))
                    continue
                self.log.warning("a step of %d requests failed (%s: %s): stepping them in halves to find the "
                                 "cause", len(group), type(exc).__name__, exc)
                half = len(group) // 2
                groups += [group[half:], group[:half]]

    def _save(self, group: list[str]) -> tuple[list[str], list[str], list[RequestSnapshot]]:
        states = {s.request_id: s for s in self.prefilling} | self.running
        pages = (lambda state: self.pages.snapshot(state.slot)) if self.pages is not None else (lambda state: None)
        return list(self.running), [s.request_id for s in self.prefilling], [
            RequestSnapshot.take(states[r], pages(states[r])) for r in group]

    def _restore(self, saved: tuple[list[str], list[str], list[RequestSnapshot]]) -> None:
        """Undo a failed step for its requests: their fields, their queue (in its old order) and their slot."""
        running_order, prefilling_order, snapshots = saved
        for snapshot in snapshots:
            state = snapshot.state
            self.running.pop(state.request_id, None)
            self.prefilling = [s for s in self.prefilling if s is not state]
            if state.slot < 0 <= snapshot.slot:  # it finished in the failed step: take its slot back
                self.free_slots.remove(snapshot.slot)
                heapq.heapify(self.free_slots)
                if self.prefix_cache is not None:
                    self.prefix_cache.forget(snapshot.slot)
                if self.pages is not None:  # and its pages (no step has given them out since)
                    self.pages.retake(snapshot.slot, *snapshot.pages)
            snapshot.restore()
            if state.status == Status.RUNNING:
                self.running[state.request_id] = state
            else:
                self.prefilling.append(state)
        rank = {r: i for i, r in enumerate(running_order)}
        self.running = dict(sorted(self.running.items(), key=lambda item: rank.get(item[0], len(rank))))
        rank = {r: i for i, r in enumerate(prefilling_order)}
        self.prefilling.sort(key=lambda state: rank.get(state.request_id, len(rank)))

    def _drop_pending(self, saved) -> None:
        """The undone step committed nothing: its slots keep none of its tokens (the family drops them)."""
        slots = [snapshot.state.slot for snapshot in saved[2] if snapshot.state.slot >= 0]
        if slots and self.target.commits_state:
            self.target.commit(self.state, torch.tensor(slots, device=self.device),
                               torch.zeros(len(slots), dtype=torch.long, device=self.device))

    def _check_device(self, exc: Exception) -> None:
        """A device error (a CUDA assert) is sticky: every later step would fail too, so it is the worker's
        fault, not the request's."""
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError as device_error:
                raise WorkerFault(f"the device failed ({device_error}) after {type(exc).__name__}: {exc}") from exc

    def _fail(self, request_id: str, exc: Exception) -> StepEvent:
        """A request that fails a step on its own: logged with its parameters and dropped, its slot freed."""
        state = self.running.pop(request_id, None) or next(s for s in self.prefilling if s.request_id == request_id)
        self.prefilling = [s for s in self.prefilling if s is not state]
        request = state.request
        self.log.error("request %s fails the step on its own and is dropped (%s: %s); prompt of %d tokens, "
                       "max_tokens %d, %s, num_speculative_tokens %s, logprobs %s, at %d tokens generated",
                       request_id, type(exc).__name__, exc, len(request.prompt_ids), request.max_tokens,
                       request.sampling, request.num_speculative_tokens, request.logprobs, len(state.output_ids),
                       exc_info=exc)
        state.finish_reason, state.error = "error", f"{type(exc).__name__}: {exc}"
        self._free(state, "error")
        return StepEvent(request_id, [], "error", state.stats, error=state.error)
