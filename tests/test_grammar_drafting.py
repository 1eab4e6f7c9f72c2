"""Drafts under a request's grammar (draft_worker/grammar_drafting.py): the drafter's copy of the grammar state
follows the committed tokens the verifier sends, survives a retried call, asks for a resync where it lost count,
and drafts without a grammar it cannot follow; every chooser proposes only tokens the grammar allows, leaves the
state where it was, and reports the q it drew from; the grammar fields travel over the wire."""

import time

import pytest
import torch
from tokenizers import Tokenizer

from draft_worker.grammar_drafting import DraftGrammars, masked_drafts, token_chooser, walk_chooser
from gateway.structured_outputs import Constraint, grammar_text
from shared.config_json import read_config
from shared.demo_models import DEMO_DIR
from shared.draft_codec import items_from_message, request_message
from shared.feature_transport import Outgoing
from shared.grammar import folder_vocabulary
from shared.grammar_matcher import GrammarMatcher, allowed_tokens
from shared.proposals import DraftItem
from shared.sampling_params import SamplingParams
from shared.target_facts import TargetFacts
from shared.tensor_frames import to_raw

TARGET = DEMO_DIR / "target"
GRAMMAR = grammar_text(Constraint("regex", "(alpha|beta)-[0-9]{2,4}( [a-c]+)?", "test"))


@pytest.fixture(scope="module")
def vocabulary():
    vocab = read_config(TARGET)["vocab_size"]
    return folder_vocabulary(TARGET, vocab, TargetFacts.from_config(read_config(TARGET)).eos_token_ids)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(TARGET / "tokenizer.json"))


def item(tokens, start, grammar=None, rid="r"):
    return DraftItem(request_id=rid, context_start=5, context_features=torch.zeros(0, 4), anchor_token=1,
                     num_draft=3, sampling=SamplingParams(), seed=0, grammar=grammar, grammar_start=start,
                     grammar_tokens=tuple(tokens))


def test_the_drafter_state_follows_the_committed_tokens(vocabulary, tokenizer):
    grammars = DraftGrammars(vocabulary)
    ids = tokenizer.encode("alpha-12").ids
    first = grammars.sync(item(ids[:2], 0, GRAMMAR))
    assert first.matcher is not None and len(first.matcher.recorded) == 2
    again = grammars.sync(item(ids[2:], 2))
    assert again.matcher is first.matcher and len(again.matcher.recorded) == len(ids)
    retried = grammars.sync(item(ids[2:], 2))  # the same call again (drafted request by request after a failure)
    assert retried.matcher is first.matcher and len(retried.matcher.recorded) == len(ids)
    lost = grammars.sync(item([], len(ids) + 3))  # a count it never saw: the verifier resends everything
    assert lost.resync and lost.matcher is None and "r" not in grammars.matchers
    rebuilt = grammars.sync(item(ids, 0, GRAMMAR))
    assert rebuilt.matcher is not None and len(rebuilt.matcher.recorded) == len(ids)
    grammars.release("r")
    assert grammars.sync(item(ids, len(ids))).matcher is None  # released: drafted without a grammar


def test_a_grammar_the_drafter_cannot_follow_is_dropped_not_fatal(vocabulary, tokenizer):
    grammars = DraftGrammars(vocabulary)
    refused = tokenizer.encode("gamma").ids  # not a start the grammar allows: another tokenizer, say
    assert grammars.sync(item(refused, 0, GRAMMAR)).matcher is None
    assert grammars.sync(item(refused, 0, GRAMMAR)).matcher is None  # and not built again for this request
    assert grammars.sync(item([], 0, "this is not a grammar %%%", rid="bad")).matcher is None
    assert grammars.sync(item(tokenizer.encode("beta").ids, 0, GRAMMAR, rid="good")).matcher is not None


def legal_rows(vocabulary, grammar, tokens) -> list[torch.Tensor]:
    """The mask [V] after each prefix of tokens (tokens[:t] for t = 0 .. len - 1)."""
    matcher = GrammarMatcher.build(vocabulary, grammar)
    bitmask = torch.zeros(len(tokens) + 1, matcher.words, dtype=torch.int32)
    assert matcher.block_masks(tokens, bitmask, 0) == len(tokens)  # every draft legal
    return list(allowed_tokens(bitmask, vocabulary.vocab_size))[: len(tokens)]


class Selector(torch.nn.Module):
    def __init__(self, vocab, rank):
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.predecessor_codebook = torch.nn.Parameter(torch.randn(vocab, rank, generator=generator))
        self.successor_codebook = torch.nn.Parameter(torch.randn(vocab, rank, generator=generator))


class Drafter:
    """What walk_chooser reads of a DFlash 2 drafter: its selector's codebooks and its top-k."""

    def __init__(self, vocab, rank=4):
        self.candidate_selector = Selector(vocab, rank)

    def candidates(self, logits, k):
        return logits.topk(k, dim=-1)


@pytest.mark.parametrize("chooser", ["argmax", "dense", "sparse", "walk greedy", "walk sampled"])
def test_every_chooser_drafts_only_what_the_grammar_allows(vocabulary, chooser):
    vocab, n = vocabulary.vocab_size, 7
    generator = torch.Generator().manual_seed(11)
    for trial in range(6):
        matcher = GrammarMatcher.build(vocabulary, GRAMMAR)
        logits = torch.randn(n, vocab, generator=generator) * 4  # [n, V]: the drafter prefers what the grammar refuses
        uniforms = torch.rand(n, generator=generator, dtype=torch.float64)
        sampling = SamplingParams(temperature=1.0, top_p=0.9)
        choose = {
            "argmax": lambda: token_chooser(sampling, None, None),
            "dense": lambda: token_chooser(sampling, uniforms, None),
            "sparse": lambda: token_chooser(sampling, uniforms, 8),
            "walk greedy": lambda: walk_chooser(Drafter(vocab), torch.randn(n, 4, generator=generator), logits,
                                                0.0, None, 8),
            "walk sampled": lambda: walk_chooser(Drafter(vocab), torch.randn(n, 4, generator=generator), logits,
                                                 1.0, uniforms, 8),
        }[chooser]()
        result = masked_drafts(matcher, logits, n, 1, choose)
        tokens = result.tokens.tolist()
        assert matcher.recorded == [] and len(tokens) >= 3, tokens  # the state restored; "alpha-" or "beta-" at least
        masks = legal_rows(vocabulary, GRAMMAR, tokens)
        if chooser in ("argmax", "walk greedy"):
            assert result.q_probs is None
            if chooser == "argmax":  # the best the grammar allows
                assert all(int(logits[t].masked_fill(~masks[t], float("-inf")).argmax()) == tokens[t]
                           for t in range(len(tokens)))
            continue
        q = result.q_probs.double()
        assert torch.allclose(q.sum(-1), torch.ones(len(tokens), dtype=torch.float64), atol=1e-5)
        for t, token in enumerate(tokens):
            ids = torch.arange(vocab) if result.q_ids is None else result.q_ids[t]
            mass = q[t] > 0
            assert masks[t][ids[mass]].all()  # q only on what the grammar allows
            assert token in ids[mass].tolist()  # and the token drawn from it


def test_the_grammar_fields_cross_the_wire():
    items = [item([5, 6], 3, GRAMMAR, rid="a"), item([], 0, rid="b")]
    features = torch.zeros(0, 4)
    message = request_message(7, items, Outgoing(frames=to_raw(features), session="", dtype="float32",
                                                 shape=[0, 4]))
    back = items_from_message(message, features)
    assert [(i.grammar, i.grammar_start, i.grammar_tokens) for i in back] == [(GRAMMAR, 3, (5, 6)), (None, 0, ())]


def test_a_draft_worker_drafts_under_the_grammar_over_its_socket(vocabulary, tokenizer):
    """The draft worker's server and the verify worker's RemoteProposer over TCP, the demo pair's DFlash 2 drafter
    with the target's grammar vocabulary, "drafted" mode: the pong says the drafter masks grammars, the calls carry
    the grammar and the committed tokens, greedy constrained output equals plain constrained output, and drafts are
    accepted (an unaware drafter's are mostly refused on the demo pair)."""
    import logging
    import threading

    from draft_worker.draft_checkpoint import load_drafter
    from draft_worker.local_proposer import LocalProposer
    from draft_worker.server import DraftMetrics, DraftServer
    from server_harness import free_port_block
    from shared.draft_config import DraftConfig
    from structured_schemas import SCHEMAS
    from verify_worker.engine import SpeculativeEngine
    from verify_worker.remote_proposer import RemoteProposer
    from shared.generation_request import GenerationRequest
    from verify_worker.target_loader import load_target

    target = load_target(TARGET)
    drafter = load_drafter(DEMO_DIR / "draft2")
    local = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=8, max_requests=8,
                          max_model_len=512, grammar_vocabulary=vocabulary)
    address = f"tcp://127.0.0.1:{free_port_block(1)}"
    server = DraftServer(local, address, DraftMetrics(), logging.getLogger("test"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    remote = RemoteProposer(address, DraftConfig.from_dict(read_config(DEMO_DIR / "draft2")), block_size=8)
    for _ in range(200):
        remote.tick()
        if remote.available:
            break
        time.sleep(0.02)
    assert remote.available and remote.masks_grammars
    eos = tuple(vocabulary.eos_tokens)
    prompt = tuple(tokenizer.encode("Answer in JSON.\n").ids)
    requests = [GenerationRequest(prompt, 48, SamplingParams(), eos,
                                  grammar=grammar_text(Constraint("json_schema", schema, "t")))
                for schema in SCHEMAS[:6]]
    plain = SpeculativeEngine(target, None, max_requests=6, max_model_len=512,
                              grammar_vocabulary=vocabulary).generate(requests)
    spec = SpeculativeEngine(target, remote, max_requests=6, max_model_len=512, grammar_vocabulary=vocabulary,
                             grammar_drafts="drafted").generate(requests)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(r.stats.accepted_tokens for r in spec) > sum(len(r.token_ids) for r in spec) // 3
    assert len(local.grammars.compiled.fresh) == 6  # each schema compiled once in the drafter
