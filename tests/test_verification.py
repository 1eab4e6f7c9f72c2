"""Unit tests of the pure acceptance rules."""

import torch

from cuda_ext.verify.reference import dense_proposal, verify_greedy, verify_sampled
from shared.sampling import sample_from, sampling_probs


def one_hot_logits(argmaxes, vocab=6):
    """Logits [b, n+1, vocab] whose argmax at each position is given."""
    ids = torch.tensor(argmaxes)
    return torch.nn.functional.one_hot(ids, vocab).float() * 5


def test_greedy_prefix_match():
    logits = one_hot_logits([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    draft = torch.tensor([[1, 2, 3], [1, 5, 3], [0, 2, 3], [1, 2, 0]])
    num = torch.tensor([3, 3, 3, 2])
    accepted, nxt = verify_greedy(draft, num, logits)
    assert accepted.tolist() == [3, 1, 0, 2]
    assert nxt.tolist() == [4, 2, 1, 3]  # bonus after all accepted; the target's token at the first miss


def test_greedy_ignores_padding_and_zero_drafts():
    logits = one_hot_logits([[1, 2, 3], [4, 4, 4]])
    draft = torch.tensor([[1, 2], [4, 4]])
    accepted, nxt = verify_greedy(draft, torch.tensor([1, 0]), logits)
    assert accepted.tolist() == [1, 0] and nxt.tolist() == [2, 4]


def test_dense_proposal_forms():
    draft = torch.tensor([2, 0])
    point = dense_proposal(draft, 4, None, None)
    assert point.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]
    sparse = dense_proposal(draft, 4, torch.tensor([[0.7, 0.3], [0.4, 0.6]]), torch.tensor([[2, 3], [1, 0]]))
    assert torch.allclose(sparse, torch.tensor([[0, 0, 0.7, 0.3], [0.6, 0.4, 0, 0]]))


def empirical_first_token(p, q, rows=400_000, seed=0):
    """Draw d ~ q, verify one drafted position, return the distribution of the first committed token."""
    gen = torch.Generator().manual_seed(seed)
    vocab = p.shape[-1]
    draft = sample_from(q.expand(rows, -1), torch.rand(rows, generator=gen, dtype=torch.float64))[:, None]
    target = p.expand(rows, 2, -1)  # the same p at both positions
    accepted, nxt = verify_sampled(draft, torch.ones(rows, dtype=torch.long), target, q.expand(rows, 1, -1),
                                   torch.rand(rows, 1, generator=gen, dtype=torch.float64),
                                   torch.rand(rows, generator=gen, dtype=torch.float64))
    first = torch.where(accepted == 1, draft[:, 0], nxt)
    return torch.bincount(first, minlength=vocab).double() / rows, accepted.double().mean()


def assert_close_distribution(empirical, exact, rows=400_000):
    sigma = (exact * (1 - exact) / rows).sqrt()
    assert ((empirical - exact).abs() <= 5 * sigma + 1e-12).all(), (empirical, exact)


def test_rejection_sampling_keeps_p_for_dense_q():
    p = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
    q = torch.tensor([0.1, 0.1, 0.3, 0.3, 0.2])
    empirical, acceptance = empirical_first_token(p, q)
    assert_close_distribution(empirical, p)
    assert abs(acceptance - torch.minimum(p, q).sum()) < 0.005  # the optimal acceptance rate sum(min(p, q))


def test_rejection_sampling_keeps_p_for_point_mass_and_sparse_q():
    p = torch.tensor([0.3, 0.4, 0.2, 0.1])
    point = torch.tensor([0.0, 0.0, 1.0, 0.0])  # a deterministic draft of token 2
    assert_close_distribution(empirical_first_token(p, point)[0], p)
    sparse = dense_proposal(torch.tensor([0]), 4, torch.tensor([[0.8, 0.2]]), torch.tensor([[3, 1]]))[0]
    assert_close_distribution(empirical_first_token(p, sparse)[0], p)


def test_all_accepted_draws_the_bonus_from_the_last_position():
    p = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    draft = torch.tensor([[0, 1]])
    q = torch.nn.functional.one_hot(draft, 3).float()
    accepted, nxt = verify_sampled(draft, torch.tensor([2]), p, q, torch.zeros(1, 2, dtype=torch.float64),
                                   torch.tensor([0.5], dtype=torch.float64))
    assert accepted.tolist() == [2] and nxt.tolist() == [2]


def test_sampling_probs_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    one = torch.tensor([1.0])
    full = sampling_probs(logits, one, one, torch.tensor([0]))
    assert torch.allclose(full, torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    top_k = sampling_probs(logits, one, one, torch.tensor([2]))
    assert torch.allclose(top_k, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    top_p = sampling_probs(logits, one, torch.tensor([0.8]), torch.tensor([0]))
    assert torch.allclose(top_p, torch.tensor([[0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0]]))
    top_p = sampling_probs(logits, one, torch.tensor([0.7]), torch.tensor([0]))  # 0.5 + 0.25 reaches 0.7
    assert torch.allclose(top_p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    boundary = sampling_probs(logits, one, torch.tensor([0.75]), torch.tensor([0]))  # mass before 0.15 is 0.75
    assert torch.allclose(boundary, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    # top_p 1 never cuts, with or without top-k, even where the running sum rounds up to 1.0 early
    tail = torch.tensor([[0.0, -18.0, -18.0, -30.0, -40.0]])
    assert (sampling_probs(tail, one, one, torch.tensor([3])) > 0).sum() == 3
    assert (sampling_probs(tail, one, one, torch.tensor([0])) > 0).sum() == 5
    tiny_p = sampling_probs(logits, one, torch.tensor([0.01]), torch.tensor([0]))
    assert tiny_p.tolist() == [[1.0, 0.0, 0.0, 0.0]]  # always at least the most likely token
    hot = sampling_probs(logits, torch.tensor([2.0]), one, torch.tensor([0]))
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))


def test_sampling_probs_mixed_rows_match_a_plain_sort_reference():
    """Rows with and without cuts in one batch, large vocabularies: the same kept tokens and probabilities as
    the textbook definition (sort, top-k, renormalise, keep the prefix whose mass before it is < top_p)."""

    def reference(logits, temperature, top_p, top_k):
        probs = torch.softmax(logits / temperature, -1)
        ranked, order = probs.sort(descending=True)
        if top_k:
            ranked = ranked * (torch.arange(len(ranked)) < top_k)
        ranked = ranked / ranked.sum()
        if top_p < 1:  # top_p 1 cuts nothing (the running sum can reach 1.0 early by rounding)
            ranked = ranked * ((ranked.cumsum(0) - ranked) < top_p)
        return torch.zeros_like(probs).scatter_(0, order, ranked / ranked.sum())

    gen = torch.Generator().manual_seed(4)
    for vocab in (3, 257, 4096):
        logits = torch.randn(6, 2, vocab, generator=gen) * 4
        temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0, 0.5])[:, None]
        top_p = torch.tensor([1.0, 0.95, 0.5, 1.0, 0.9, 0.01])[:, None]
        top_k = torch.tensor([0, 0, 0, 2, 50, 0])[:, None]
        got = sampling_probs(logits, temperature, top_p, top_k)
        for r in range(6):
            for c in range(2):
                want = reference(logits[r, c], temperature[r, 0], top_p[r, 0], int(top_k[r, 0]))
                assert torch.equal(got[r, c] > 0, want > 0), (vocab, r, c)
                assert torch.allclose(got[r, c], want, atol=1e-6), (vocab, r, c)


def test_inverse_cdf_never_picks_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(1000, -1)
    ids = sample_from(probs, torch.linspace(0, 1 - 1e-12, 1000, dtype=torch.float64))
    assert set(ids.tolist()) == {1, 3}
