"""RemoteProposer against a scripted drafter on a real ZeroMQ socket: proposals it cannot verify (ids outside
the vocabulary, more tokens than asked) cost drafts, never a request; a drafter whose connection closes
mid-call is given up on at once, and one that stops answering is given up on at its measured deadline. The
deadline itself: pure."""

import logging
import threading
import time

import pytest
import torch
import zmq
from conftest import tiny_draft_config
from server_harness import free_port_block

from draft_worker.draft_checkpoint import random_drafter
from draft_worker.local_proposer import LocalProposer
from draft_worker.server import DraftMetrics, DraftServer
from shared.channel_draft import TO_DRAFTER, DraftReply, DraftRequest, Ping, Pong
from shared.draft_codec import reply_message, request_message, stacked_features
from shared.feature_transport import FrameTransport
from shared.proposals import DraftItem, DraftResult, ProposerUnavailable
from shared.sampling_params import SamplingParams
from shared.wire import decode, encode
from verify_worker.draft_deadline import DraftDeadline
from verify_worker.remote_proposer import RemoteProposer

VOCAB = 128


class ScriptedDrafter:
    """A ROUTER that answers pings, and each draft call with the next behaviour of its script: "good" (the
    drafts asked for), "bad_ids", "too_many", "silent" (no answer) or "close" (the socket closes)."""

    def __init__(self, address: str, script: list[str]):
        self.address, self.script = address, list(script)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            if not self.socket.poll(20):
                continue
            identity, *frames = self.socket.recv_multipart()
            message = decode(frames, TO_DRAFTER)
            if isinstance(message, Ping):
                pong = Pong(call_id=message.call_id, drafter_kind="dflash", block_size=8, masks_grammars=False)
                self.socket.send_multipart([identity, *encode(pong)])
                continue
            if not isinstance(message, DraftRequest):
                continue
            action = self.script.pop(0) if self.script else "good"
            if action == "close":
                self.socket.close(linger=0)
                return
            if action == "silent":
                continue
            counts = [n + (action == "too_many") for n in message.num_drafts]
            token = VOCAB + 5 if action == "bad_ids" else 1
            results = [DraftResult(tokens=torch.full((n,), token, dtype=torch.long)) for n in counts]
            self.socket.send_multipart([identity, *encode(reply_message(message.call_id, results, 0.001, 0.0002))])
        self.socket.close(linger=0)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.context.term()


def items(n_features: int = 2) -> list[DraftItem]:
    return [DraftItem(f"r{i}", 0, torch.zeros(n_features, 2 * 64), 1, 3, SamplingParams(), 0) for i in range(2)]


def connected(script: list[str], **deadline) -> tuple[RemoteProposer, ScriptedDrafter]:
    address = f"tcp://127.0.0.1:{free_port_block(1)}"
    drafter = ScriptedDrafter(address, script)
    proposer = RemoteProposer(address, tiny_draft_config(vocab=VOCAB), deadline=DraftDeadline(**deadline))
    give_up = time.monotonic() + 10
    while not proposer.available and time.monotonic() < give_up:  # pings go out from tick(), never waiting
        proposer.tick()
        time.sleep(0.01)
    assert proposer.available
    return proposer, drafter


@pytest.mark.parametrize("bad", ["bad_ids", "too_many"])
def test_proposals_that_cannot_be_verified_cost_drafts_not_requests(bad):
    proposer, drafter = connected(["good", bad], cap_s=5.0)
    try:
        assert [len(r.tokens) for r in proposer.propose(items())] == [3, 3]
        with pytest.raises(ProposerUnavailable, match="bad proposals"):
            proposer.propose(items())
        assert not proposer.available and proposer.bad_messages == 1
    finally:
        drafter.stop()


def test_a_drafter_that_closes_its_connection_is_given_up_on_at_once():
    proposer, drafter = connected(["close"], cap_s=5.0)
    try:
        began = time.monotonic()
        with pytest.raises(ProposerUnavailable, match="closed its connection"):
            proposer.propose(items())
        assert time.monotonic() - began < 2.0  # not the 5 s cap
    finally:
        drafter.stop()


def test_a_silent_drafter_is_given_up_on_at_its_measured_deadline():
    """Steady calls (little context each) set the deadline: 8x their median, at least the floor; a call that
    catches up on more context than a step commits may wait up to the cap."""
    proposer, drafter = connected(["good"] * 4 + ["silent"], cap_s=5.0, floor_s=0.3)
    try:
        for _ in range(4):
            proposer.propose(items())
        assert list(proposer.deadline.ingested) == [(0.0002, 4)] * 4  # what the drafter said its rows took
        assert proposer.deadline.timeout() == pytest.approx(0.3)
        began = time.monotonic()
        with pytest.raises(ProposerUnavailable, match="no answer within 0.30 s"):
            proposer.propose(items())
        assert time.monotonic() - began < 2.0
    finally:
        drafter.stop()


def test_a_call_waits_in_proportion_to_its_context_rows():
    """Until a large call has measured what a context row costs, a call's deadline is the steady one's plus its
    extra rows at the upper bound base / base_rows (itself the margin): the first draft after a few plain steps
    waits a fraction of a second, a new prompt's whole context up to the cap."""
    deadline = DraftDeadline(cap_s=5.0, floor_s=0.25, multiple=8.0, min_samples=4)
    for _ in range(8):
        deadline.observe(0.02, catch_up=False, rows=4)
    assert deadline.timeout(rows=120) == pytest.approx(8 * 0.02 + 0.005 * 116)
    assert deadline.timeout(rows=2) == 0.25  # never below the steady deadline
    assert deadline.timeout(rows=4000) == 5.0


def test_large_calls_measure_the_cost_of_a_row():
    """Calls carrying many context rows (a new prompt, the draft after a run of plain steps) measure the cost of
    one more row; with it a large call's deadline is the steady call plus its extra rows at that cost, not the
    steady call scaled by its rows: after 64 plain steps of 16 requests (1024 rows) a hung drafter costs the
    streams 8 x 50 ms, where the scaled rule waited out the 5 s cap."""
    deadline = DraftDeadline(cap_s=5.0, floor_s=0.25, multiple=8.0, min_samples=4)
    for _ in range(8):
        deadline.observe(0.02, catch_up=False, rows=4)
    assert deadline.timeout(rows=1024) == 5.0  # 8 x 0.02 s + 1020 rows at the bound of 5 ms: the cap
    assert deadline.timeout(rows=200) == pytest.approx(8 * 0.02 + 0.005 * 196)  # the bound is its own margin
    deadline.observe(0.05, catch_up=True, rows=1004)  # 30 us a row above the steady call
    deadline.observe(0.35, catch_up=True, rows=2004)  # a slow one (a fresh kernel): the median ignores it
    deadline.observe(0.08, catch_up=True, rows=2004)
    assert deadline.row_seconds(0.02, 4) == pytest.approx(30e-6)
    assert deadline.timeout(rows=1024) == pytest.approx(8 * (0.02 + 30e-6 * 1020))
    assert deadline.timeout(rows=4) == 0.25  # a steady call keeps the steady deadline
    assert deadline.timeout(rows=10 ** 6) == 5.0  # and the cap holds
    deadline.observe(0.05, catch_up=True, rows=6)  # too few rows to say what a row costs: not used
    assert deadline.row_seconds(0.02, 4) == pytest.approx(30e-6)
    for _ in range(4):  # large calls faster than the steady median (noise): a row costs at least nothing
        deadline.observe(0.01, catch_up=True, rows=3004)
    assert deadline.row_seconds(0.02, 4) == 0.0 and deadline.timeout(rows=1024) == 0.25
    deadline.reset()
    assert deadline.timeout(rows=1024) == 5.0 and not deadline.large


def test_the_drafters_ingest_time_bounds_a_row_until_a_large_call_measures_it():
    """A drafter restarted shortly before a hang has answered only steady one-request calls: 6 ms for 2 rows,
    of which it spent 0.1 ms writing the rows into its cache. Its ingest time per row (50 us), not the whole
    call per row (3 ms), bounds a large call's rows, with the multiple: a probe after 64 plain steps of 16
    streams (1024 rows) waits 8 x (6 ms + 1022 x 50 us) = 0.46 s, where the call-per-row bound waited 3 s."""
    deadline = DraftDeadline(cap_s=5.0, floor_s=0.25, multiple=8.0, min_samples=4)
    for _ in range(4):
        deadline.observe(0.006, catch_up=False, rows=2, ingest_seconds=0.0001)
    assert deadline.row_seconds(0.006, 2) == pytest.approx(50e-6)
    assert deadline.timeout(rows=1024) == pytest.approx(8 * (0.006 + 50e-6 * 1022))
    without = DraftDeadline(cap_s=5.0, floor_s=0.25, multiple=8.0, min_samples=4)
    for _ in range(4):
        without.observe(0.006, catch_up=False, rows=2)  # a drafter that does not say
    assert without.timeout(rows=1024) == pytest.approx(8 * 0.006 + 0.003 * 1022)
    deadline.observe(0.03, catch_up=False, rows=64, ingest_seconds=0.0009)  # a 16-request call: 14 us a row
    assert deadline.row_seconds(0.006, 2) == pytest.approx(0.0009 / 64)  # the closest bound of the recent calls
    deadline.observe(0.016, catch_up=True, rows=1004)  # a large call measured the row: 10 us above the steady one
    assert deadline.row_seconds(0.006, 2) == pytest.approx(0.010 / 1002)
    for _ in range(2):  # large calls of many more requests than the steady ones: their blocks count as rows
        deadline.observe(0.706, catch_up=True, rows=1002)
    assert deadline.row_seconds(0.006, 2) == pytest.approx(0.0009 / 64)  # the drafter's figure caps that
    assert deadline.timeout(rows=1024) == 0.25  # 8 x (6 ms + 1022 x 14 us): under the floor
    deadline.reset()
    assert not deadline.ingested and deadline.timeout(rows=1024) == 5.0


def test_a_restarted_drafter_is_timed_from_its_first_answered_calls_of_either_kind():
    """A drafter restarted while 16 streams decode plainly answers few steady calls (probes are rare) and some
    large ones (new prompts): after min_samples answered calls of either kind its deadline follows them (the
    SIGSTOP drill after a SIGKILL stalled 16 streams for the 5 s cap with 2 steady calls measured)."""
    deadline = DraftDeadline(cap_s=5.0, floor_s=0.25, multiple=8.0, min_samples=4)
    deadline.observe(0.006, catch_up=False, rows=1)
    deadline.observe(0.004, catch_up=False, rows=9)
    deadline.observe(0.005, catch_up=True, rows=17)
    assert deadline.timeout(rows=299) == 5.0  # three answers: still the cap
    deadline.observe(0.017, catch_up=True, rows=92)
    assert deadline.timeout(rows=299) == 0.25  # 5 ms + 290 rows at the median marginal cost: under the floor
    only_large = DraftDeadline(cap_s=5.0, floor_s=0.25, multiple=8.0, min_samples=4)
    for rows in (100, 200, 300, 400):
        only_large.observe(0.001 * rows / 10, catch_up=True, rows=rows)  # 0.1 ms a row
    assert only_large.timeout(rows=1000) == pytest.approx(8 * 0.025 + 1e-4 * 750)  # rows at the bound base / rows


def test_draft_deadline():
    deadline = DraftDeadline(cap_s=5.0, floor_s=0.25, multiple=8.0, min_samples=4)
    assert deadline.timeout() == 5.0  # nothing measured yet
    for seconds in (0.01, 0.05, 0.02, 0.03):
        deadline.observe(seconds, catch_up=False)
    deadline.observe(3.0, catch_up=True)  # a catch-up call says nothing about steady ones
    assert deadline.timeout() == 0.25  # 8 x 0.025 is under the floor
    assert deadline.timeout(rows=1000) == 5.0  # a whole prompt's context: up to the cap
    for _ in range(8):
        deadline.observe(0.1, catch_up=False)
    assert deadline.timeout() == pytest.approx(0.8)
    for _ in range(32):
        deadline.observe(2.0, catch_up=False)
    assert deadline.timeout() == 5.0  # never past the cap
    deadline.reset()
    assert deadline.timeout() == 5.0


def test_the_draft_worker_reports_the_time_its_context_rows_took():
    """The draft worker's reply says how long the call spent writing its context rows into the cache: a part of
    the call's time, and unmeasured (None) for a call drafted request by request after a failure."""
    cfg = tiny_draft_config(vocab=VOCAB)
    embed = torch.randn(VOCAB, cfg.hidden_size) * 0.02
    proposer = LocalProposer(random_drafter(cfg, seed=1), embed, embed, max_requests=4, max_model_len=64)
    server = DraftServer(proposer, f"inproc://ingest-{id(proposer)}", DraftMetrics(), logging.getLogger("test"))
    try:
        calls = [items(n_features=6), [DraftItem(f"r{i}", 6, torch.zeros(0, 2 * 64), 1, 3, SamplingParams(), 0)
                                       for i in range(2)]]
        for call_id, call in enumerate(calls, 1):
            features = stacked_features(call, 2 * 64)
            reply = server.handle(request_message(call_id, call, FrameTransport().outgoing(features)))
            assert isinstance(reply, DraftReply) and sum(reply.counts) == 6
            assert 0 < reply.ingest_seconds < reply.draft_seconds  # (a call without rows: the checks alone)
        def fails_together(batch):
            if len(batch) > 1:
                raise RuntimeError("one of these requests breaks the batch")
            return [DraftResult(torch.ones(3, dtype=torch.long))]

        proposer.propose = fails_together
        reply = server.handle(request_message(3, items(), FrameTransport().outgoing(stacked_features(items(), 128))))
        assert reply.ingest_seconds is None and reply.counts == [3, 3]
    finally:
        server.socket.close(linger=0)
