"""The feature pair transport: the same code moves the tensors over gloo on CPU and over NCCL between two CUDA
devices (skipped unless two are present); the draft message carries only dtype, shape and session."""

import multiprocessing

import pytest
import torch
from tp_ranks import free_port, pair_transfer


def run_pair(device, tmp_path):
    context = multiprocessing.get_context("spawn")
    verify_end, draft_end = context.Pipe()
    out, port = tmp_path / "pair.pt", free_port()
    processes = [context.Process(target=pair_transfer, args=(rank, 2, port, device, pipe, str(out)))
                 for rank, pipe in ((0, verify_end), (1, draft_end))]
    for p in processes:
        p.start()
    for p in processes:
        p.join(120)
        assert p.exitcode == 0
    return torch.load(out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL pair)"))])
def test_pair_transport_moves_features_and_renews_its_session(device, tmp_path):
    got = run_pair(device, tmp_path)
    assert len(got["received"]) == 3
    for received, sent in zip(got["received"], got["sent"]):
        assert received.shape == sent.shape and torch.equal(received, sent)
    first, _, third = got["sessions"]
    assert first and got["sessions"][1] == first and third != first


def test_frames_and_unknown_transports():
    from shared.errors import DFlashError
    from shared.feature_transport import FrameTransport, make_transport

    features = torch.randn(3, 4)
    transport = FrameTransport()
    outgoing = transport.outgoing(features)
    assert outgoing.session == "" and torch.equal(transport.pull(outgoing.frames, "", "", []), features)
    with pytest.raises(DFlashError, match="unknown feature transport"):
        make_transport("carrier-pigeon", None, True, "cpu")
    with pytest.raises(DFlashError, match="--feature-pair-addr"):
        make_transport("pair", None, True, "cpu")
