"""DraftItem / DraftResult <-> channel_draft messages (torch side of the verify <-> draft channel)."""

import torch

from shared.channel_draft import DraftReply, DraftRequest
from shared.feature_transport import Outgoing
from shared.proposals import DraftItem, DraftResult
from shared.sampling_params import SamplingParams
from shared.tensor_frames import from_raw, to_raw


def stacked_features(items: list[DraftItem], feature_width: int) -> torch.Tensor:
    """[sum of rows, taps * hidden]: every item's new context features, in item order."""
    features = [item.context_features for item in items if len(item.context_features)]
    return torch.cat(features) if features else torch.zeros(0, feature_width)


def request_message(call_id: int, items: list[DraftItem], outgoing: Outgoing) -> DraftRequest:
    return DraftRequest(
        call_id=call_id,
        request_ids=[i.request_id for i in items],
        context_starts=[i.context_start for i in items],
        feature_rows=[len(i.context_features) for i in items],
        anchor_tokens=[i.anchor_token for i in items],
        num_drafts=[i.num_draft for i in items],
        temperatures=[float(i.sampling.temperature) for i in items],
        top_ps=[float(i.sampling.top_p) for i in items],
        top_ks=[i.sampling.top_k for i in items],
        seeds=[i.seed for i in items],
        grammars=[i.grammar for i in items],
        grammar_starts=[i.grammar_start for i in items],
        grammar_tokens=[list(i.grammar_tokens) for i in items],
        features=outgoing.frames, pair_session=outgoing.session, feature_dtype=outgoing.dtype,
        feature_shape=outgoing.shape,
    )


def items_from_message(message: DraftRequest, features: torch.Tensor) -> list[DraftItem]:
    """features: the message's features as the transport delivered them. Raises RequestError (a DFlashError)
    when a sampling setting is invalid."""
    items, row = [], 0
    for i, request_id in enumerate(message.request_ids):
        rows = message.feature_rows[i]
        items.append(DraftItem(
            request_id=request_id, context_start=message.context_starts[i],
            context_features=features[row: row + rows], anchor_token=message.anchor_tokens[i],
            num_draft=message.num_drafts[i],
            sampling=SamplingParams(message.temperatures[i], message.top_ps[i], message.top_ks[i]),
            seed=message.seeds[i], grammar=message.grammars[i], grammar_start=message.grammar_starts[i],
            grammar_tokens=tuple(message.grammar_tokens[i]),
        ))
        row += rows
    return items


def _kind(result: DraftResult) -> str:
    if result.tokens is None or result.q_probs is None:
        return "none"
    return "dense" if result.q_ids is None else "sparse"


def reply_message(call_id: int, results: list[DraftResult], draft_seconds: float,
                  ingest_seconds: float | None = None) -> DraftReply:
    served = [r for r in results if r.tokens is not None]
    with_q = [r for r in served if r.q_probs is not None]
    tokens = torch.cat([r.tokens for r in served]) if served else torch.zeros(0, dtype=torch.long)
    q_probs = to_raw(torch.cat([r.q_probs.float() for r in with_q])) if with_q else None
    sparse = [r for r in with_q if r.q_ids is not None]
    q_ids = to_raw(torch.cat([r.q_ids.long() for r in sparse])) if sparse else None
    return DraftReply(
        call_id=call_id, resync=[r.tokens is None for r in results],
        counts=[0 if r.tokens is None else len(r.tokens) for r in results], tokens=to_raw(tokens.long()),
        q_kinds=[_kind(r) for r in results], q_probs=q_probs, q_ids=q_ids, draft_seconds=draft_seconds,
        ingest_seconds=ingest_seconds,
    )


def results_from_message(message: DraftReply) -> list[DraftResult]:
    tokens = from_raw(message.tokens)
    q_probs = from_raw(message.q_probs) if message.q_probs is not None else None
    q_ids = from_raw(message.q_ids) if message.q_ids is not None else None
    results, row, q_row = [], 0, 0
    for resync, count, kind in zip(message.resync, message.counts, message.q_kinds):
        if resync:
            results.append(DraftResult(tokens=None))
            continue
        result = DraftResult(tokens=tokens[row: row + count])
        if kind != "none":
            result.q_probs = q_probs[q_row: q_row + count]
            result.q_ids = q_ids[q_row: q_row + count] if kind == "sparse" else None
            q_row += count
        results.append(result)
        row += count
    return results
