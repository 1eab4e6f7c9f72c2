"""What --kv-cache-budget-mb counts per request (verify_worker.server.request_bytes) is what a request holds: the
target's KV cache and the feature rows the engine keeps for the drafter."""

from draft_worker.local_proposer import LocalProposer
from shared.generation_request import GenerationRequest
from verify_worker.engine import SpeculativeEngine
from verify_worker.server import request_bytes


def test_request_bytes_counts_the_feature_rows_the_engine_keeps(qwen3_pair):
    _, target, drafter, _ = qwen3_pair
    taps = len(drafter.config.target_layer_ids)
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, max_requests=2, max_model_len=128)
    engine = SpeculativeEngine(target, proposer, max_requests=2, max_model_len=128)
    state = engine.add(GenerationRequest(tuple(range(1, 30)), 24))
    while engine.has_work() and len(state.output_ids) < 12:
        engine.step()
    kept = sum(chunk.numel() * chunk.element_size() for chunk in state.feature_chunks)
    per_token = request_bytes(target, 1, taps) - target.state_bytes_per_slot(1)
    assert per_token > 0 and kept == state.cache_len * per_token  # one row per committed position
    assert request_bytes(target, 128, taps) == target.state_bytes_per_slot(128) + 128 * per_token
    assert request_bytes(target, 128, 0) == target.state_bytes_per_slot(128)  # no drafter: the cache alone
