"""Drafter training: the anchor mask, train/inference consistency, and a loss that goes down."""

import torch
from conftest import tiny_draft_config

from draft_worker.draft_checkpoint import random_drafter
from training.masks import block_visibility, position_weights
from training.trainer import DrafterTrainer, Example, TrainSettings, walk_acceptance


def test_mask_never_shows_context_at_or_after_the_anchor():
    anchors = torch.tensor([0, 3, 9, 4])  # unsorted on purpose: visibility follows positions, not order
    context_len, block = 12, 5
    mask = block_visibility(anchors, context_len, block, torch.tensor([5, 5, 2, 5]))
    assert mask.shape == (4 * block, context_len + 4 * block)
    for i, anchor in enumerate(anchors.tolist()):
        rows = mask[i * block: (i + 1) * block]
        context = rows[:, :context_len]
        assert context[:, :anchor].all() and not context[:, anchor:].any()
        blocks = rows[:, context_len:].view(block, 4, block)
        for j in range(4):
            if j != i:
                assert not blocks[:, j].any()  # never another block's rows
        live = 2 if i == 2 else 5
        assert blocks[:, i, :live].all() and not blocks[:, i, live:].any()


def test_walk_acceptance_follows_decoding_not_the_mean_over_anchors():
    # anchor 0 accepts 3 drafts (4 tokens), so decoding next drafts from anchor 4, skipping the easy anchors 1-3
    leads = [3, 7, 7, 7, 0, 0, 1, 5, 0]
    tokens, steps = walk_acceptance(leads)
    assert (tokens, steps) == (4 + 1 + 1 + 2 + 1, 5)  # anchors 0, 4, 5, 6, 8
    assert tokens / steps < 1 + sum(leads) / len(leads)


def test_position_weights_decay_and_skip_the_anchor():
    w = position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and torch.all(w[2:] < w[1:-1])
    assert abs(float(w[8]) - torch.exp(torch.tensor(-1.0)).item()) < 1e-6


def test_training_forward_equals_the_cached_inference_forward(qwen3_pair):
    """One block whose anchor sits right after the context: the training path (all blocks in one masked
    forward) and the serving path (context cache, then a block) give the same drafter logits."""
    _, target, _, _ = qwen3_pair
    drafter = random_drafter(tiny_draft_config(layers=2, block_size=6), seed=9, std=0.2)
    trainer = DrafterTrainer(target, drafter, TrainSettings(steps=1))
    ids = torch.randint(0, 120, (20,), generator=torch.Generator().manual_seed(4))
    anchor = 13
    features, _ = trainer.target_view(ids)
    example = Example(ids, 1)
    block_ids, positions, _, _, lengths = trainer.layout(example, torch.tensor([3, anchor]))
    mask = block_visibility(torch.tensor([3, anchor]), len(ids), 6, lengths)
    train_hidden = drafter.train_hidden(features, target.embed_weight[block_ids], positions, mask)[6:]
    cache = drafter.new_cache(1, 64)
    drafter.ingest_context(cache, torch.zeros(anchor, dtype=torch.long), torch.arange(anchor), features[:anchor])
    served = drafter.block_hidden(cache, torch.tensor([0]), torch.tensor([anchor]),
                                  target.embed_weight[block_ids[6:]][None])[0]
    assert (train_hidden - served).abs().max() < 1e-4


def test_a_few_steps_lower_the_loss(qwen3_pair):
    _, target, _, _ = qwen3_pair
    drafter = random_drafter(tiny_draft_config(layers=1, block_size=8), seed=2, std=0.05)
    gen = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(0, 120, (48,), generator=gen), 8) for _ in range(4)]
    trainer = DrafterTrainer(target, drafter, TrainSettings(steps=60, lr=3e-3, anchors_per_sequence=16))
    before = sum(trainer.sequence_loss(e, torch.arange(8, 40, 4))[0].item() for e in examples)
    trainer.train(examples, log=lambda _: None)
    after = sum(trainer.sequence_loss(e, torch.arange(8, 40, 4))[0].item() for e in examples)
    assert after < 0.8 * before, (before, after)
    report = trainer.evaluate(examples)
    assert len(report["per_position_accuracy"]) == 7 and report["acceptance_length_greedy"] >= 1.0


def test_short_blocks_train_and_validation_uses_whole_blocks(qwen3_pair):
    """With blocks cut to 8 rows during training, validation still scores whole blocks of every position."""
    _, target, _, _ = qwen3_pair
    drafter = random_drafter(tiny_draft_config(layers=1, block_size=16), seed=2, std=0.05)
    trainer = DrafterTrainer(target, drafter, TrainSettings(steps=2, short_block_probability=0.5,
                                                            anchors_per_sequence=12))
    example = Example(torch.randint(0, 120, (64,), generator=torch.Generator().manual_seed(1)), 4)
    _, _, _, _, lengths = trainer.layout(example, torch.arange(4, 40, 3))
    assert set(lengths.tolist()) == {8, 16}
    trainer.train([example], log=lambda _: None)
    report = trainer.evaluate([example])
    assert len(report["per_position_accuracy"]) == 15

