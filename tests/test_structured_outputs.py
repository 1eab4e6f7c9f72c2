"""Grammar-constrained decoding is exact and obeys its grammar: on the demo pair, greedy constrained speculative
output equals greedy constrained plain output token for token (the DFlash and DFlash 2 drafters drafting under the
grammar, and drafting without it with masks on the target only, drafts cut at their first refused token, forced
tokens proposed), every finished output validates
against its schema; the end-of-sequence inside a verify block, min_tokens against a completed grammar, and a
constrained sampled position's distribution, plain and drafted (chi-square)."""

import json

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from draft_worker.draft_checkpoint import load_drafter
from draft_worker.local_proposer import LocalProposer
from gateway.structured_outputs import Constraint, grammar_text
from shared.config_json import read_config
from shared.demo_models import DEMO_DIR
from shared.generation_request import GenerationRequest
from shared.grammar import folder_vocabulary
from shared.grammar_matcher import GrammarMatcher, allowed_tokens
from shared.sampling_params import SamplingParams
from shared.target_facts import TargetFacts
from verify_worker.engine import SpeculativeEngine
from verify_worker.target_loader import load_target

TARGET = DEMO_DIR / "target"
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 3,
     "items": {"enum": ["a", "b", "def"]}}}, "required": ["ok", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer",
     "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x", "y"],
     "additionalProperties": False}, "kind": {"anyOf": [{"const": "dot"}, {"type": "integer", "minimum": 0,
     "maximum": 99}]}}, "required": ["point", "kind"], "additionalProperties": False},
]
PROMPTS = ["def parse(text):\n    return json.loads(", "# a record as JSON\nrecord = "]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def demo():
    target = load_target(TARGET)
    facts = TargetFacts.from_config(read_config(TARGET))
    vocabulary = folder_vocabulary(TARGET, target.config.vocab_size, facts.eos_token_ids)
    tokenizer = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    return target, vocabulary, tokenizer, list(vocabulary.eos_tokens)


def proposer_of(target, kind: str, max_requests: int = 8, vocabulary=None, max_model_len: int = 1024) -> LocalProposer:
    """The demo drafter of that kind; with the grammar vocabulary, drafting under constrained requests' grammars."""
    drafter = load_drafter(DEMO_DIR / ("draft2" if kind == "dflash2" else "draft"))
    return LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=8,
                         max_requests=max_requests, max_model_len=max_model_len, grammar_vocabulary=vocabulary)


def constrained_requests(tokenizer, eos, grammars, sampling=SamplingParams(), **extra):
    return [GenerationRequest(tuple(tokenizer.encode(prompt).ids), NEW_TOKENS, sampling, tuple(eos), grammar=grammar,
                              **extra)
            for grammar in grammars for prompt in PROMPTS]


def grammars_of(constraints):
    return [grammar_text(c) for c in constraints]


def test_greedy_constrained_speculation_equals_constrained_plain_and_obeys_the_schemas(demo):
    target, vocabulary, tokenizer, eos = demo
    constraints = [Constraint("json_schema", s, "test") for s in SCHEMAS]
    constraints += [Constraint("regex", r"(foo|bar)[0-9]{2,4}-[a-z]+", "test"),
                    Constraint("choice", ["alpha", "beta", "gamma delta"], "test"),
                    Constraint("json_object", {"type": "object"}, "test")]
    requests = constrained_requests(tokenizer, eos, grammars_of(constraints))
    plain = SpeculativeEngine(target, None, max_requests=len(requests), max_model_len=1024,
                              grammar_vocabulary=vocabulary).generate(requests)
    for kind, mode, aware in [("dflash2", "masked", True), ("dflash", "drafted", True), ("dflash2", "forced", False),
                              ("dflash2", "target", False), ("dflash", "cut", False)]:
        proposer = proposer_of(target, kind, len(requests), vocabulary if aware else None)
        engine = SpeculativeEngine(target, proposer, max_requests=len(requests), max_model_len=1024,
                                   grammar_vocabulary=vocabulary, grammar_drafts=mode)
        spec = engine.generate(requests)
        for request, want, got in zip(requests, plain, spec):
            assert got.token_ids == want.token_ids, (kind, mode, aware, tokenizer.decode(request.prompt_ids))
        assert sum(r.stats.draft_tokens for r in spec) > 0
    finished = 0
    for index, (constraint, result) in enumerate(zip([c for c in constraints for _ in PROMPTS], plain)):
        text = tokenizer.decode([t for t in result.token_ids if t not in eos])
        if result.finish_reason != "stop":
            continue
        finished += 1
        if constraint.kind == "json_schema":
            jsonschema.validate(json.loads(text), constraint.spec)
        elif constraint.kind == "json_object":
            assert isinstance(json.loads(text), dict), text
        elif constraint.kind == "choice":
            assert text in constraint.spec, text
    assert finished >= len(requests) // 2, [r.finish_reason for r in plain]


def test_a_grammar_refuses_what_it_must_and_rolls_back_exactly(demo):
    """The matcher's masks of a block: the legal prefix of a draft, the end-of-sequence inside the block (nothing
    after it), and its state restored after computing them."""
    _, vocabulary, tokenizer, eos = demo
    matcher = GrammarMatcher.build(vocabulary, grammar_text(Constraint("choice", ["ab", "cd"], "t")))
    ids = tokenizer.encode("ab").ids
    draft = ids + [eos[0]] + ids
    bitmask = torch.full((len(draft) + 1, matcher.words), -1, dtype=torch.int32)
    assert matcher.block_masks(draft, bitmask, 0) == len(ids) + 1  # nothing after the end
    assert matcher.recorded == [] and matcher.legal_prefix(tokenizer.encode("cd").ids) == len(tokenizer.encode("cd").ids)
    assert matcher.legal_prefix(tokenizer.encode("x").ids) == 0
    assert matcher.take(ids + [eos[0]]) == len(ids) + 1
    matcher.undo(1)  # the end taken back: the grammar is complete, an end again is the only token allowed
    assert matcher.legal_prefix([eos[0]]) == 1 and matcher.legal_prefix(ids[:1]) == 0


def test_the_end_inside_a_verify_block_and_a_request_that_ignores_it(demo):
    """A grammar that forces its whole text and then its end: the end arrives as a forced draft inside a verify
    block; a request that ignores the end (no stop tokens) gets the text, then nothing but ends, speculative as
    plain."""
    target, vocabulary, tokenizer, eos = demo
    grammar = grammar_text(Constraint("regex", "print[(]'done'[)]", "t"))
    text = tokenizer.encode("print('done')").ids
    for stops in (tuple(eos), ()):
        request = GenerationRequest(tuple(tokenizer.encode(PROMPTS[1]).ids), 24, SamplingParams(), stops,
                                    grammar=grammar)
        plain = SpeculativeEngine(target, None, max_requests=1, max_model_len=1024,
                                  grammar_vocabulary=vocabulary).generate([request])[0]
        spec = SpeculativeEngine(target, proposer_of(target, "dflash2"), max_requests=1, max_model_len=1024,
                                 grammar_vocabulary=vocabulary).generate([request])[0]
        assert spec.token_ids == plain.token_ids
        assert tokenizer.decode(plain.token_ids[:-1] if stops else plain.token_ids[:len(text)]) == "print('done')"
        if stops:
            assert plain.finish_reason == "stop" and plain.token_ids[-1] == eos[0]
            assert spec.stats.verify_steps <= 2  # the text forced in one block, its end in the next
        else:
            assert plain.finish_reason == "length" and set(plain.token_ids[len(text):]) == {eos[0]}


def test_min_tokens_cannot_extend_a_completed_grammar(demo):
    target, vocabulary, tokenizer, eos = demo
    grammar = grammar_text(Constraint("choice", ["yes", "no"], "t"))
    request = GenerationRequest(tuple(tokenizer.encode(PROMPTS[0]).ids), 20, SamplingParams(), tuple(eos),
                                min_tokens=10, grammar=grammar)
    result = SpeculativeEngine(target, proposer_of(target, "dflash2"), max_requests=1, max_model_len=1024,
                               grammar_vocabulary=vocabulary).generate([request])[0]
    assert result.finish_reason == "stop" and tokenizer.decode(result.token_ids[:-1]) in ("yes", "no")


def masked_joint(target, vocabulary, grammar: str, prompt: tuple, length: int, eos) -> dict[tuple, float]:
    """The exact probability of every output's first `length` tokens (shorter where it ends) under temperature 1
    with the grammar's masks: each prefix's next-token distribution from the target, masked and renormalised."""
    joint, frontier = {}, [((), 1.0)]
    while frontier:
        prefix, mass = frontier.pop()
        if len(prefix) == length or (prefix and prefix[-1] in eos):
            joint[prefix] = joint.get(prefix, 0.0) + mass
            continue
        matcher = GrammarMatcher.build(vocabulary, grammar)
        matcher.take(list(prefix))
        bitmask = torch.zeros(1, matcher.words, dtype=torch.int32)
        matcher.fill(bitmask, 0)
        allowed = allowed_tokens(bitmask, target.config.vocab_size)[0]
        ids = prompt + prefix
        with torch.inference_mode():
            hidden = target(torch.tensor([ids]), torch.arange(len(ids))[None], None, None).hidden[0, -1]
            probs = torch.softmax(target.logits(hidden).double().masked_fill(~allowed, float("-inf")), -1)
        frontier += [(prefix + (token,), mass * float(probs[token])) for token in allowed.nonzero().flatten().tolist()]
    return joint


def test_constrained_sampled_positions_keep_the_masked_distribution(demo):
    """The four tokens of four letters, sampled (temperature 1; 1,000 seeded requests): the first from the prompt's
    step, the next three verified drafts and a bonus token (464 outcomes). Plain decoding and speculative decoding
    (DFlash 2 drafting without the grammar; DFlash 2 and DFlash drafting under it, their q masked) all follow the
    exact distribution of the target masked by the grammar (chi-square over every outcome, seeded: deterministic). A
    drafter that reports a q other than the one it drew from fails it (uniform over the same tokens: p < 1e-40)."""
    from test_sampling_lossless import chi_square_p_value

    target, vocabulary, tokenizer, eos = demo
    grammar = grammar_text(Constraint("regex", "[a-d]( [a-d]){3}", "t"))
    prompt = tuple(tokenizer.encode("x = '").ids)
    joint = masked_joint(target, vocabulary, grammar, prompt, 4, set(eos))
    outcomes = sorted(joint)
    probs = torch.tensor([joint[o] for o in outcomes], dtype=torch.float64)
    count, batch = 1000, 100
    for proposer in (None, proposer_of(target, "dflash2", batch, None, 64),
                     proposer_of(target, "dflash2", batch, vocabulary, 64), proposer_of(target, "dflash", batch, vocabulary, 64)):
        requests = [GenerationRequest(prompt, 4, SamplingParams(1.0, 1.0, 0, seed), tuple(eos), grammar=grammar)
                    for seed in range(count)]
        engine = SpeculativeEngine(target, proposer, max_requests=batch, max_model_len=64,
                                   grammar_vocabulary=vocabulary, grammar_drafts="drafted")
        results = engine.generate(requests)
        counts = torch.zeros(len(outcomes), dtype=torch.float64)
        for result in results:
            counts[outcomes.index(tuple(result.token_ids[:4]))] += 1  # an outcome outside the grammar: ValueError
        if proposer is not None:
            assert sum(r.stats.draft_tokens for r in results) > 0
        assert chi_square_p_value(counts, probs) > 1e-3, proposer


@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm5_next"])
def test_glm_families_greedy_constrained_speculation_equals_constrained_plain(family, tmp_path):
    """Tiny random GLM-5.2 and GLM-5.3-Flash checkpoints with a byte tokenizer and a random DFlash drafter: greedy
    constrained speculative output (drafts under the grammar; without it, forced tokens and cuts, and masks alone)
    equals constrained plain output."""
    from conftest import tiny_draft_config

    from draft_worker.draft_checkpoint import random_drafter
    from shared.byte_tokenizer import END_OF_TEXT, write_byte_tokenizer

    if family == "glm_moe_dsa":
        from test_glm_moe_dsa import TINY as text, random_glm as build
    else:
        from test_glm5_next import TEXT as text, random_glm5 as build
    build(seed=5, vocab_size=258, eos_token_id=256).save_pretrained(tmp_path)
    write_byte_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": END_OF_TEXT}))
    target = load_target(tmp_path)
    vocabulary = folder_vocabulary(tmp_path, target.config.vocab_size, (256,))
    layers = text["num_hidden_layers"]
    drafter = random_drafter(tiny_draft_config(target_layers=layers, vocab=258, hidden=32,
                                               target_layer_ids=(1, layers - 1), block_size=6), seed=3, std=0.2)
    grammars = grammars_of([Constraint("json_schema", SCHEMAS[1], "t"), Constraint("regex", "[a-c]{3,8}!", "t"),
                            Constraint("choice", ["north", "south"], "t")])
    requests = [GenerationRequest(tuple(b"data = "), 24, SamplingParams(), (256,), grammar=g)
                for g in grammars]
    plain = SpeculativeEngine(target, None, max_requests=3, max_model_len=128,
                              grammar_vocabulary=vocabulary).generate(requests)
    for mode, aware in (("drafted", True), ("forced", False), ("target", False)):
        proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=6, max_requests=3,
                                 max_model_len=128, grammar_vocabulary=vocabulary if aware else None)
        spec = SpeculativeEngine(target, proposer, max_requests=3, max_model_len=128, grammar_vocabulary=vocabulary,
                                 grammar_drafts=mode).generate(requests)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain], (mode, aware)
        assert sum(r.stats.draft_tokens for r in spec) > 0
    assert bytes(plain[2].token_ids[:-1]).decode() in ("north", "south")


def test_a_target_whose_end_the_tokenizer_lacks_serves_no_grammars(tmp_path):
    """A config's eos id the tokenizer does not have (a byte tokenizer on a 152k-logit model) is no grammar end; the
    tokenizer_config's end-of-text token is."""
    from shared.byte_tokenizer import END_OF_TEXT, write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    assert folder_vocabulary(tmp_path, 151936, (151645,)) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": END_OF_TEXT}))
    vocabulary = folder_vocabulary(tmp_path, 151936, (151645,))
    matcher = GrammarMatcher.build(vocabulary, grammar_text(Constraint("regex", "a+", "t")))
    assert vocabulary.eos_tokens == [256] and matcher.words == 151936 // 32


def test_a_thinking_end_lands_at_its_budget_speculative_as_plain(demo):
    """thinking_end (budget, token): the token at output index budget unless it came before, greedy and sampled,
    speculative and plain; greedy speculative output equal to plain."""
    target, vocabulary, tokenizer, eos = demo
    close = tokenizer.encode(":").ids[0]  # a stand-in for </think>: any token id
    prompts = [tuple(tokenizer.encode(p).ids) for p in PROMPTS]
    for sampling in (SamplingParams(), SamplingParams(1.0, 1.0, 0, 7)):
        requests = [GenerationRequest(p, 12, sampling, (), thinking_end=(budget, close))
                    for p in prompts for budget in (0, 3, 9)]
        plain = SpeculativeEngine(target, None, max_requests=6, max_model_len=256).generate(requests)
        spec = SpeculativeEngine(target, proposer_of(target, "dflash2", 6, max_model_len=256), max_requests=6,
                                 max_model_len=256).generate(requests)
        if sampling.greedy:  # sampled: speculation draws other numbers, so only the rule is compared
            assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        for request, result in zip(requests * 2, plain + spec):
            budget = request.thinking_end[0]
            assert close in result.token_ids[: budget + 1], (budget, result.token_ids)
