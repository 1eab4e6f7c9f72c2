"""Rank entry points for tests/test_tensor_parallel.py: each runs in its own process (torch.multiprocessing
spawn) inside a gloo group on loopback. Rank 0 writes what it computed to a file the test reads."""

import os
import socket
import sys

import torch

from verify_worker.families.interface import StepBatch
from verify_worker.parallel.driver import TargetLeader, follow
from verify_worker.parallel.group import GroupSettings, join_group, leave_group
from verify_worker.target_loader import load_target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(entry, world_size: int, *args) -> None:
    """Run entry(rank, world_size, port, *args) in world_size processes; raises if any fails."""
    torch.multiprocessing.spawn(_start, args=(entry, world_size, free_port(), args), nprocs=world_size, join=True)


def _start(rank, entry, world_size, port, args):
    torch.set_num_threads(1)
    entry(rank, world_size, port, *args)
    # The rank's work is saved and its group torn down: leave without running C++ static destructors. A rank
    # was killed by SIGABRT ("terminate called without an active exception") in about one full test run in
    # three, never in isolation; skipping interpreter teardown is meant to avoid that exit path.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _joined_target(rank, world_size, port, folder, pack=True):
    tp = join_group(GroupSettings(rank, world_size, "127.0.0.1", port, "gloo", timeout_s=60), "cpu")
    return load_target(folder, dtype="float32", tp=tp, pack=pack)


def logits_and_shards(rank, world_size, port, folder, out_path):
    """A batched prefill of two prompts of different lengths, then one incremental step; rank 0 saves the
    logits, and every rank the shapes of what it loaded."""
    target = _joined_target(rank, world_size, port, folder, pack=False)
    shapes = {name: tuple(t.shape) for name, t in target.state_dict().items()}  # the checkpoint's names
    target.pack()  # then the served layout: packed row-parallel layers all-reduce too
    if rank > 0:
        follow(target)
        torch.save(shapes, f"{out_path}.rank{rank}")
        leave_group(target.tp)
        return
    leader = TargetLeader(target)
    state = leader.new_state(2, 32)
    ids = torch.tensor([[5, 17, 3, 99, 42, 7], [8, 8, 120, 64, 0, 0]])
    positions = torch.arange(6)[None].repeat(2, 1)
    prefill = leader.logits(leader.step(StepBatch(ids, positions, torch.tensor([0, 1])), state, (1, 2)).hidden)
    step_ids, step_positions = torch.tensor([[11], [33]]), torch.tensor([[6], [4]])
    out = leader.step(StepBatch(step_ids, step_positions, torch.tensor([0, 1])), state, (1, 2))
    step = leader.logits(out.hidden)
    leader.stop()
    torch.save({"prefill": prefill, "step": step, "taps": out.taps, "shapes": shapes}, out_path)
    leave_group(target.tp)


def engine_generate(rank, world_size, port, folder, draft_folder, prompts, out_path):
    """Greedy generation through the engine on a tensor-parallel target, with a DFlash drafter (whose
    embedding and lm_head come from a whole copy of the target, as the draft worker loads them)."""
    from draft_worker.draft_checkpoint import load_drafter
    from draft_worker.local_proposer import LocalProposer
    from shared.sampling_params import SamplingParams
    from verify_worker.engine import SpeculativeEngine
    from shared.generation_request import GenerationRequest

    target = _joined_target(rank, world_size, port, folder)
    if rank > 0:
        follow(target)
        leave_group(target.tp)
        return
    whole = load_target(folder, dtype="float32")
    proposer = LocalProposer(load_drafter(draft_folder, dtype=torch.float32), whole.embed_weight,
                             whole.lm_head_weight, max_requests=len(prompts), max_model_len=256)
    leader = TargetLeader(target)
    engine = SpeculativeEngine(leader, proposer, max_requests=len(prompts), max_model_len=256)
    requests = [GenerationRequest(tuple(p), 24, SamplingParams()) for p in prompts]
    results = engine.generate(requests)
    leader.stop()
    torch.save({"tokens": [r.token_ids for r in results],
                "accepted": sum(r.stats.accepted_tokens for r in results)}, out_path)
    leave_group(target.tp)


def pair_transfer(rank, world_size, port, device, pipe, out_path):
    """Verify end (rank 0) and draft end (rank 1) of a feature pair. Draft messages go through a pipe as
    their real wire frames; the tensors over the pair. Rank 1 saves what it received."""
    from shared.channel_draft import TO_DRAFTER
    from shared.draft_codec import items_from_message, request_message, stacked_features
    from shared.feature_transport import PairTransport
    from shared.proposals import DraftItem
    from shared.sampling_params import SamplingParams
    from shared.wire import decode, encode

    dev = f"{device}:{rank}" if device == "cuda" else "cpu"
    transport = PairTransport(f"127.0.0.1:{port}", sender=rank == 0, device=dev, timeout_s=20)
    calls = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    calls[1] = calls[1][:0]  # a call with no new context rows
    if rank == 0:
        for i, features in enumerate(calls):
            items = [DraftItem("a", 0, features, 7, 3, SamplingParams(), 1)]
            if i == 2:
                transport.reset()  # as after a drafter restart: a new session, a new group
            outgoing = transport.outgoing(stacked_features(items, 8))
            pipe.send([bytes(f) for f in encode(request_message(i, items, outgoing))])
            transport.push(stacked_features(items, 8), outgoing)
        pipe.send(None)
        pipe.recv()  # the receiver is done
        return
    received, sessions = [], []
    while (frames := pipe.recv()) is not None:
        message = decode(frames, TO_DRAFTER)
        features = transport.pull(message.features, message.pair_session, message.feature_dtype,
                                  message.feature_shape)
        assert message.features is None  # nothing but metadata went through the message
        received.append(items_from_message(message, features)[0].context_features.cpu())
        sessions.append(message.pair_session)
    torch.save({"received": received, "sent": calls, "sessions": sessions}, out_path)
    pipe.send("done")


def sparse_logits(rank, world_size, port, folder, out_path):
    """Contexts past a sparse target's index_topk: a batched prefill of two prompts, then a 4-token verify
    block on each; rank 0 saves the logits and taps, every rank the shapes of what it loaded."""
    target = _joined_target(rank, world_size, port, folder)
    shapes = {name: tuple(t.shape) for name, t in target.state_dict().items()}
    if rank > 0:
        follow(target)
        torch.save(shapes, f"{out_path}.rank{rank}")
        leave_group(target.tp)
        return
    leader = TargetLeader(target)
    torch.save({**sparse_calls(leader), "shapes": shapes}, out_path)
    leader.stop()
    leave_group(target.tp)


def sparse_calls(target) -> dict:
    """The calls sparse_logits makes, on any target (a TargetLeader or a whole target)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 36), generator=generator)
    state = target.new_state(2, 64)
    slots = torch.tensor([0, 1])
    prefill = target.logits(target.step(StepBatch(ids[:, :32], torch.arange(32)[None].repeat(2, 1), slots), state).hidden)
    block = target.step(StepBatch(ids[:, 32:], torch.arange(32, 36)[None].repeat(2, 1), slots), state, (1, 3))
    return {"prefill": prefill, "block": target.logits(block.hidden), "taps": block.taps}


class RecordingFamily:
    """A real target whose commit and reset do something (they record their arguments), as a recurrent family's
    would: the leader must announce them and every follower must run them in the same order."""

    commits_state = True

    def __init__(self, target):
        self.target, self.calls = target, []

    def __getattr__(self, name):
        return getattr(self.target, name)

    def commit(self, state, slots, kept):
        self.calls.append(("commit", slots.tolist(), kept.tolist()))

    def reset(self, state, slot):
        self.calls.append(("reset", slot))


def commits_mirrored(rank, world_size, port, folder, out_path):
    family = RecordingFamily(_joined_target(rank, world_size, port, folder))
    if rank > 0:
        follow(family)
        torch.save(family.calls, f"{out_path}.rank{rank}")
        leave_group(family.tp)
        return
    leader = TargetLeader(family)
    state = leader.new_state(2, 16)
    leader.reset(state, 1)
    leader.step(StepBatch(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], torch.tensor([1])), state)
    leader.commit(state, torch.tensor([1]), torch.tensor([3]))
    leader.reset(state, 0)
    leader.commit(state, torch.tensor([0, 1]), torch.tensor([2, 1]))
    leader.stop()
    torch.save(family.calls, out_path)
    leave_group(family.tp)
