"""The wire format: round trips, and rejection of wrong versions, types, fields and shapes."""

import msgpack
import pytest
import torch

from shared.channel_draft import TO_DRAFTER, TO_VERIFIER, DraftReply, DraftRequest
from shared.channel_gateway import TO_GATEWAY, TO_VERIFY, TokenBatch, TokenEvent
from shared.draft_codec import (
    items_from_message,
    reply_message,
    request_message,
    results_from_message,
    stacked_features,
)
from shared.feature_transport import FrameTransport
from shared.generation_request import GenerationRequest
from shared.proposals import DraftItem, DraftResult
from shared.sampling_params import SamplingParams
from shared.tensor_frames import from_raw, to_raw
from shared.wire import WireError, decode, encode


def submit():
    return GenerationRequest(request_id="r1", prompt_ids=[1, 2, 3], max_tokens=10,
                             sampling=SamplingParams(0.7, 0.9, 0, 42),
                             stop_token_ids=[256], min_tokens=2)


def tokens(request_id, token_ids, finish_reason, verify_steps, draft_tokens, accepted_tokens, **rest) -> TokenEvent:
    return TokenEvent(request_id=request_id, token_ids=token_ids, finish_reason=finish_reason,
                      verify_steps=verify_steps, draft_tokens=draft_tokens, accepted_tokens=accepted_tokens, **rest)


def frame_message(call_id, items):
    return request_message(call_id, items, FrameTransport().outgoing(stacked_features(items, 8)))


def test_round_trip_without_tensors():
    assert decode(encode(submit()), TO_VERIFY) == submit()


def test_draft_round_trip_with_tensors_and_mixed_proposals():
    features = torch.randn(5, 8)
    items = [
        DraftItem("a", 0, features[:3], 7, 3, SamplingParams(0.0), 1),
        DraftItem("b", 4, features[3:], 9, 2, SamplingParams(1.0, 0.9), 2),
        DraftItem("c", 2, features[:0], 1, 1, SamplingParams(1.0), 3),
    ]
    message = decode(encode(frame_message(11, items)), TO_DRAFTER)
    back = items_from_message(message, FrameTransport().pull(message.features, "", "", []))
    assert [i.request_id for i in back] == ["a", "b", "c"]
    assert torch.equal(back[0].context_features, features[:3]) and torch.equal(back[1].context_features, features[3:])
    assert back[1].sampling == SamplingParams(1.0, 0.9) and back[2].context_features.shape == (0, 8)
    results = [DraftResult(torch.tensor([1, 2, 3])), DraftResult(None),
               DraftResult(torch.tensor([4]), q_probs=torch.tensor([[0.25, 0.75]]), q_ids=torch.tensor([[4, 5]]))]
    reply = decode(encode(reply_message(11, results, 0.01)), TO_VERIFIER)
    got = results_from_message(reply)
    assert got[0].tokens.tolist() == [1, 2, 3] and got[0].q_probs is None
    assert got[1].tokens is None
    assert got[2].q_ids.tolist() == [[4, 5]] and got[2].q_probs.tolist() == [[0.25, 0.75]]


def test_bfloat16_tensors_travel():
    t = torch.randn(3, 4).to(torch.bfloat16)
    assert torch.equal(from_raw(to_raw(t)), t)


def tamper(frames, **changes):
    header = msgpack.unpackb(bytes(frames[0]))
    header.update(changes)
    return [msgpack.packb(header), *frames[1:]]


def test_wrong_version_type_and_channel_are_rejected():
    frames = encode(submit())
    with pytest.raises(WireError, match="schema version"):
        decode(tamper(frames, v=99), TO_VERIFY)
    with pytest.raises(WireError, match="unknown message type"):
        decode(tamper(frames, type="launch_missiles"), TO_VERIFY)
    with pytest.raises(WireError, match="unknown message type 'submit'"):
        decode(frames, TO_GATEWAY)
    with pytest.raises(WireError, match="undecodable"):
        decode([b"\xc1garbage"], TO_VERIFY)


def test_a_submit_is_the_engines_request_and_keeps_its_tuples():
    request = GenerationRequest((1, 2), 5, stop_token_ids=[9], thinking_end=(3, 7), request_id="r")
    frames = encode(request)
    back = decode(frames, TO_VERIFY)
    assert back == request and back.prompt_ids == (1, 2) and back.stop_token_ids == (9,)
    assert back.thinking_end == (3, 7)
    body = msgpack.unpackb(bytes(frames[0]))["body"]
    for misshapen in ([3], [3, 7, 1], [3, "x"]):  # a fixed-length tuple is checked by length and item types
        with pytest.raises(WireError, match="submit.thinking_end"):
            decode(tamper(frames, body={**body, "thinking_end": misshapen}), TO_VERIFY)
    with pytest.raises(WireError, match="empty request_id"):
        decode(tamper(frames, body={**body, "request_id": ""}), TO_VERIFY)


def test_wrong_fields_and_types_are_rejected():
    frames = encode(submit())
    body = msgpack.unpackb(bytes(frames[0]))["body"]
    with pytest.raises(WireError, match="missing fields \\['sampling'\\]"):
        decode(tamper(frames, body={k: v for k, v in body.items() if k != "sampling"}), TO_VERIFY)
    nested = body["sampling"]  # the sampling parameters travel as a map of their own fields, checked the same way
    with pytest.raises(WireError, match="submit.sampling: missing fields \\['top_k'\\]"):
        decode(tamper(frames, body={**body, "sampling": {k: v for k, v in nested.items() if k != "top_k"}}), TO_VERIFY)
    with pytest.raises(WireError, match="submit.sampling.top_p"):
        decode(tamper(frames, body={**body, "sampling": {**nested, "top_p": "high"}}), TO_VERIFY)
    with pytest.raises(WireError, match="temperature must be a finite number"):  # the record's own checks
        decode(tamper(frames, body={**body, "sampling": {**nested, "temperature": -1.0}}), TO_VERIFY)
    with pytest.raises(WireError, match="not a map of SamplingParams"):
        decode(tamper(frames, body={**body, "sampling": [0.7, 0.9, 0, 42]}), TO_VERIFY)
    with pytest.raises(WireError, match="max_tokens"):
        decode(tamper(frames, body={**body, "max_tokens": "ten"}), TO_VERIFY)
    with pytest.raises(WireError, match="prompt_ids"):
        decode(tamper(frames, body={**body, "prompt_ids": [1, "x"]}), TO_VERIFY)
    event = tokens("r", [1], None, 0, 0, 0)
    with pytest.raises(WireError, match="unexpected fields \\['extra'\\]"):
        decode(tamper(encode(event), body={**msgpack.unpackb(bytes(encode(event)[0]))["body"], "extra": 1}), TO_GATEWAY)


def test_wrong_tensor_shapes_are_rejected():
    item = DraftItem("a", 0, torch.randn(3, 8), 7, 3, SamplingParams(), 1)
    frames = encode(frame_message(1, [item]))
    header = msgpack.unpackb(bytes(frames[0]))
    header["tensors"][0]["shape"] = [4, 8]  # claims more rows than the bytes hold
    with pytest.raises(WireError, match="does not match its"):
        decode([msgpack.packb(header), frames[1]], TO_DRAFTER)
    header["tensors"][0]["shape"] = [2, 12]  # the bytes fit, but feature_rows says 3
    with pytest.raises(WireError, match="do not hold 3 rows"):
        decode([msgpack.packb(header), frames[1]], TO_DRAFTER)
    with pytest.raises(WireError, match="tensor frames"):
        decode(frames[:1], TO_DRAFTER)
    reply = reply_message(1, [DraftResult(torch.tensor([1, 2]))], 0.0)
    reply.counts = [3]
    with pytest.raises(WireError, match="tokens do not match counts"):
        decode(encode(reply), TO_VERIFIER)
    assert isinstance(decode(encode(reply_message(1, [DraftResult(torch.tensor([1]))], 0.0)), TO_VERIFIER), DraftReply)
    assert DraftRequest.TYPE == "draft"


def test_token_logprobs_travel_and_must_line_up_with_the_tokens():
    event = tokens("r", [4, 5], None, 1, 2, 1, logprobs=[-0.1, -2.0], top_ids=[[4], [7]], top_logprobs=[[-0.1], [-0.5]])
    assert decode(encode(event), TO_GATEWAY) == event
    for wrong in ({"logprobs": [-0.1]}, {"top_ids": None}, {"top_logprobs": [[-0.1], []]},
                  {"logprobs": None}):
        bad = tokens("r", [4, 5], None, 1, 2, 1, **{"logprobs": [-0.1, -2.0], "top_ids": [[4], [7]],
                                                    "top_logprobs": [[-0.1], [-0.5]], **wrong})
        with pytest.raises(WireError, match="tokens:"):
            decode(encode(bad), TO_GATEWAY)

    prompt = tokens("r", [], "length", 1, 0, 0, prompt_logprobs=[-1.0, -0.2], prompt_top_ids=[[3], [4]],
                    prompt_top_logprobs=[[-0.5], [-0.2]])  # a scored prompt, nothing generated
    assert decode(encode(prompt), TO_GATEWAY) == prompt
    with pytest.raises(WireError, match="prompt log-probability"):
        decode(encode(tokens("r", [], "length", 1, 0, 0, prompt_logprobs=[-1.0], prompt_top_ids=[[3], [4]],
                             prompt_top_logprobs=[[-0.5], [-0.2]])), TO_GATEWAY)


def test_a_token_batch_carries_a_steps_events_and_refuses_ragged_lists():
    events = [tokens("a", [1, 2, 3], None, 4, 14, 9, cached_tokens=32), tokens("b", [7], "stop", 12, 0, 0),
              tokens("c", [], "length", 1, 7, 0)]
    batch = decode(encode(TokenBatch.of(events)), TO_GATEWAY)
    assert isinstance(batch, TokenBatch) and batch.events() == events
    frames = encode(TokenBatch(request_ids=["a", "b"], token_ids=[[1], [2]], finish_reasons=[None], verify_steps=[1, 1],
                               draft_tokens=[0, 0], accepted_tokens=[0, 0], cached_tokens=[0, 0]))
    with pytest.raises(WireError, match="token_batch: per-request lists differ in length"):
        decode(frames, TO_GATEWAY)
    frames = encode(TokenBatch(request_ids=["a"], token_ids=[["x"]], finish_reasons=[None], verify_steps=[1],
                               draft_tokens=[0], accepted_tokens=[0], cached_tokens=[0]))
    with pytest.raises(WireError, match="token_batch.token_ids"):
        decode(frames, TO_GATEWAY)
