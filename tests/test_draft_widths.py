"""The narrower draft count: what a step of fewer drafts is expected to commit, the policy's choice between the
full block and it by measured step times, and that steps of either width give the plain tokens."""

from collections import deque

from draft_worker.draft_checkpoint import load_drafter
from draft_worker.local_proposer import LocalProposer
from shared.demo_models import DEMO_DIR
from shared.generation_request import GenerationRequest
from verify_worker.draft_widths import DraftWidths
from verify_worker.engine import SpeculativeEngine
from verify_worker.spec_policy import AdaptiveSpeculation
from verify_worker.target_loader import load_target


def widths_after(accepted: list[int], full: int = 7) -> DraftWidths:
    widths = DraftWidths(keep=1.0)
    widths.set_full(full)
    for a in accepted:
        widths.record_full(a)
    return widths


def test_a_narrow_step_commits_what_the_survival_of_its_positions_says():
    widths = widths_after([0, 1, 2, 3, 7])  # survival of positions 1..7: 4, 3, 2, 1, 1, 1, 1 (13 in all)
    assert widths.narrow == 3 and widths.survival == [5, 4, 3, 2, 1, 1, 1, 1]
    assert widths.acceptance_at(3.6, 3) == 1 + 2.6 * 9 / 13  # positions 1..3 hold 9 of the 13
    assert widths.acceptance_at(3.6, 7) == 3.6
    assert widths.uncensored(2, 3) == 2  # a draft was rejected: a full block commits the same
    assert widths.uncensored(4, 3) == 4 + (1 + 1 + 1 + 1) / 2  # all 3 accepted: plus those past 3 after them
    assert DraftWidths().narrow == 0 and widths_after([], full=1).narrow == 0  # nothing narrower than 1 draft


def test_the_policy_takes_the_narrow_width_where_a_wide_verify_block_costs_more_than_it_commits():
    # the 1.7B twin on a 2-core AVX2 CPU: a plain step 0.27 s, a block of 8 rows 0.95 s, of 4 rows 0.47 s
    policy = AdaptiveSpeculation()
    policy.set_block(8)
    batch = row = ["a"]
    plan = policy.plan(rows_of(batch))
    assert plan.speculate and plan.drafts is None  # nothing measured: the full block first
    for accepted in (3, 1, 0, 5, 2, 7, 1, 2, 0, 3):
        policy.observe(row, True, True, 0.95, [accepted + 1], [True], drafts=None, counts=[7])
    policy.observe(row, False, False, 0.27, [1], [False])
    plan = policy.plan(rows_of(batch))
    assert plan.drafts == 3  # the narrow width, measured once
    policy.observe(row, True, True, 0.47, [3], [True], drafts=3, counts=[3])
    # 3.4 tokens a 0.95 s step (3.6 tok/s) against 1 + 2.4 * 18 / 24 a 0.47 s step (6.0 tok/s); 3.7 tok/s plain
    assert policy.step_seconds(1, True) < 0.95 and policy.preferred_mode(batch) == "speculative"
    choices = []
    for _ in range(40):
        plan = policy.plan(rows_of(batch))
        choices.append(plan.drafts)
        drafts = 7 if plan.drafts is None else plan.drafts
        policy.observe(row, plan.speculate, True, 0.95 if drafts == 7 else 0.47, [4 if drafts == 7 else 3], [True],
                       drafts=plan.drafts, counts=[drafts])
    assert choices.count(3) >= 38 and None in choices  # narrow, with a full block now and then to stay measured


def test_the_policy_keeps_the_full_block_where_its_rows_cost_little():
    # a GPU-like step: 8 rows cost about what 4 do, so the full block commits more for the same time
    policy = AdaptiveSpeculation()
    policy.set_block(8)
    row = ["a"]
    for accepted in (3, 1, 0, 5, 2, 7, 1, 2, 0, 3):
        policy.observe(row, True, True, 0.012, [accepted + 1], [True], counts=[7])
    policy.observe(row, False, False, 0.010, [1], [False])
    policy.observe(row, True, True, 0.0115, [3], [True], drafts=3, counts=[3])
    choices = [policy.plan(rows_of(row)).drafts for _ in range(40)]
    assert choices.count(None) >= 38


def rows_of(ids):
    from verify_worker.spec_step import RowNeed

    return [RowNeed(request_id=r, asks_drafts=False, refuses_drafts=False, seeded_sampled=False, greedy=True)
            for r in ids]


def test_narrow_steps_give_the_plain_tokens_on_the_demo_pair():
    target, drafter = load_target(DEMO_DIR / "target"), load_drafter(DEMO_DIR / "draft2")
    proposer = LocalProposer(drafter, target.embed_weight, target.lm_head_weight, block_size=8, max_requests=2,
                             max_model_len=1024)
    asked = []
    propose = proposer.propose
    proposer.propose = lambda items: asked.extend(i.num_draft for i in items) or propose(items)
    policy = AdaptiveSpeculation()
    policy.set_block(8)
    for accepted in (3, 1, 0, 5, 2, 7):
        policy.widths.record_full(accepted)
    # measured times that make the narrow width the faster and speculation pay at batch sizes 1 and 2
    for bucket in (1, 2):  # (many samples, no length limit: the real steps' few do not move their medians)
        policy.step_samples[(bucket, True)] = deque([0.9] * 1001)
        policy.step_samples[(bucket, False)] = deque([0.3] * 1001)
        policy.widths.narrow_samples[bucket] = deque([0.31] * 1001)
    requests = [GenerationRequest((5, 6, 7, 8, 9, 10, 11, 12), 40), GenerationRequest((20, 21, 22, 23), 40)]
    spec = SpeculativeEngine(target, proposer, max_requests=2, max_model_len=1024, policy=policy).generate(requests)
    plain = SpeculativeEngine(target, None, max_requests=2, max_model_len=1024).generate(requests)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert asked.count(3) > asked.count(7) > 0  # mostly narrow steps, full ones now and then
