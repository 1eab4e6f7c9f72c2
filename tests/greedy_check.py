"""The near-tie rule for greedy comparisons between differently batched computations."""

import torch

from client.bench import first_divergence
from verify_worker.families.llama.model import TargetModel

NEAR_TIE = 1e-4


def top2_gap(target: TargetModel, prefix: list[int]) -> float:
    """Gap between the two largest next-token logits after prefix (one unbatched forward)."""
    cache = target.new_cache(1, len(prefix) + 1)
    ids = torch.tensor([prefix])
    out = target(ids, torch.arange(len(prefix))[None], cache, torch.tensor([0]))
    top = target.logits(out.hidden[0, -1]).topk(2).values
    return float(top[0] - top[1])


def plain_greedy(target: TargetModel, prompt: list[int], max_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """The target's own greedy continuation, one unbatched token at a time (the stop token included, as served)."""
    cache = target.new_cache(1, len(prompt) + max_tokens)
    ids, out = list(prompt), []
    hidden = target(torch.tensor([ids]), torch.arange(len(ids))[None], cache, torch.tensor([0])).hidden[0, -1]
    while len(out) < max_tokens:
        out.append(int(target.logits(hidden).argmax()))
        if out[-1] in stop_ids or len(out) == max_tokens:
            break
        position = len(prompt) + len(out) - 1
        hidden = target(torch.tensor([[out[-1]]]), torch.tensor([[position]]), cache, torch.tensor([0])).hidden[0, -1]
    return out


def assert_same_or_near_tie(target: TargetModel, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Equal token for token, or the first divergence is at a near-tie (top-2 gap < 1e-4)."""
    first = first_divergence(got, want)
    if first is None:
        return
    gap = top2_gap(target, list(prompt) + want[:first])
    assert gap < NEAR_TIE, (
        f"greedy outputs diverge at token {first} where the top-2 logit gap is {gap:.3g} (not a near-tie):\n"
        f"got  {got}\nwant {want}"
    )
