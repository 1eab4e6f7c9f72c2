"""A target on other kernels against its CPU family: greedy speculative == plain on them (drafts accepted and
rejected), and plain decoding equal to the CPU family's or diverging only at a near-tie. Shared by the interpreted
kernel scripts (kda_fla_interpreted.py, glm_kernels_interpreted.py), which print these findings as JSON."""

from greedy_check import assert_same_or_near_tie
from scripted_proposer import ScriptedProposer

from shared.generation_request import GenerationRequest
from verify_worker.engine import SpeculativeEngine

PROMPTS = ([5, 17, 3, 99, 42, 8, 61], [77, 12])


def exactness_findings(target, oracle, max_tokens: int = 6, prompts=PROMPTS, max_prefill_tokens: int = 2048) -> dict:
    """target: the family on the kernels under test; oracle: the same checkpoint as the CPU family loads it.
    Raises (assert_same_or_near_tie) where plain decoding diverges from the oracle's off a near-tie. prompts and
    max_prefill_tokens: longer prompts and a smaller budget split the prefill into chunks."""
    requests = [GenerationRequest(tuple(p), max_tokens, request_id=f"r{i}") for i, p in enumerate(prompts)]
    max_len = max(len(p) for p in prompts) + max_tokens + 16
    engine = dict(max_requests=len(prompts), max_model_len=max(64, max_len), max_prefill_tokens=max_prefill_tokens)
    plain = SpeculativeEngine(target, None, **engine).generate(requests)
    sequences = {r.request_id: list(r.prompt_ids) + p.token_ids for r, p in zip(requests, plain)}
    drafts = ScriptedProposer(sequences, block_size=4, num_layers=oracle.config.num_layers)  # right and wrong
    drafts.target_layer_ids = (0, oracle.config.num_layers - 1)  # taps that exist at any depth
    spec = SpeculativeEngine(target, drafts, **engine).generate(requests)
    want = SpeculativeEngine(oracle, None, **engine).generate(requests)
    for prompt, got, expected in zip(prompts, plain, want):
        assert_same_or_near_tie(oracle, prompt, got.token_ids, expected.token_ids)
    found = {
        "kernels": sorted({m.glm_kernels.name for m in target.modules() if hasattr(m, "glm_kernels")}),
        "speculative_equals_plain": [r.token_ids for r in spec] == [r.token_ids for r in plain],
        "committed_per_step": sum(r.stats.committed_tokens for r in spec) / sum(r.stats.verify_steps for r in spec),
        "tokens_equal_oracle": [r.token_ids for r in plain] == [r.token_ids for r in want],
    }
    if target.embed_weight.device.type == "cuda":  # decode steps replayed from CUDA graphs, as --cuda-graphs runs
        drafts = ScriptedProposer(sequences, block_size=4, num_layers=oracle.config.num_layers)
        drafts.target_layer_ids = (0, oracle.config.num_layers - 1)
        graphed_engine = SpeculativeEngine(target, drafts, step_buckets="cuda-graphs", **engine)
        found["graph_shapes"] = [graphed_engine.warm_up(), len(graphed_engine.buckets.all_shapes(len(prompts)))]
        graphed = graphed_engine.generate(requests)
        found["graphed_speculative_equals_plain"] = [r.token_ids for r in graphed] == [r.token_ids for r in plain]
    return found
