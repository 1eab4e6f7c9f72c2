"""Channel verify worker <-> draft worker: draft calls with context features, proposals back, releases,
pings. Per-request fields travel as parallel lists; tensors as raw frames."""

from dataclasses import dataclass

from shared.wire import Message, RawTensor, WireError, channel


@dataclass(kw_only=True)
class DraftRequest(Message):
    TYPE = "draft"
    call_id: int
    request_ids: list[str]
    context_starts: list[int]
    feature_rows: list[int]  # rows of `features` per request, in order
    anchor_tokens: list[int]
    num_drafts: list[int]
    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    seeds: list[int]
    grammars: list[str | None]  # per request: its grammar where the drafter builds its state anew (DraftItem)
    grammar_starts: list[int]  # output tokens the drafter's grammar state had taken before grammar_tokens
    grammar_tokens: list[list[int]]  # output tokens committed since, [] for an unconstrained request
    features: RawTensor | None  # [sum(feature_rows), taps * hidden]; None when they travel over the pair
    pair_session: str  # "" = features in the frame above; else the feature pair session carrying them
    feature_dtype: str
    feature_shape: list[int]

    def validate(self):
        n = len(self.request_ids)
        lists = (self.context_starts, self.feature_rows, self.anchor_tokens, self.num_drafts, self.temperatures,
                 self.top_ps, self.top_ks, self.seeds, self.grammars, self.grammar_starts, self.grammar_tokens)
        if any(len(values) != n for values in lists):
            raise WireError("draft: per-request lists differ in length")
        if (self.features is None) != bool(self.pair_session):
            raise WireError("draft: features must come either as a frame or over a pair session")
        shape = list(self.features.shape) if self.features is not None else self.feature_shape
        if len(shape) != 2 or shape[0] != sum(self.feature_rows):
            raise WireError(f"draft: features of shape {shape} do not hold {sum(self.feature_rows)} rows")
        if any(k < 1 for k in self.num_drafts) or any(r < 0 for r in self.feature_rows):
            raise WireError("draft: num_drafts must be >= 1 and feature_rows >= 0")
        if any(start < 0 for start in self.grammar_starts):
            raise WireError("draft: grammar_starts must be >= 0")


@dataclass(kw_only=True)
class DraftReply(Message):
    TYPE = "proposals"
    call_id: int
    resync: list[bool]  # per request: True = the drafter lacks its context, resend from position 0
    counts: list[int]  # tokens per request (0 where resync)
    tokens: RawTensor  # [sum(counts)] int64
    q_kinds: list[str]  # per request: "none" (deterministic: point masses), "dense" or "sparse"
    q_probs: RawTensor | None  # rows of the requests whose kind is not "none", in order: dense [.., vocab],
    q_ids: RawTensor | None  # sparse [.., K] with the candidate ids in q_ids (one kind per reply)
    draft_seconds: float
    # of draft_seconds, the time the drafter spent writing the call's context rows into its cache (None: not
    # measured, e.g. a call drafted request by request after a failure); the verifier bounds a row's cost by it
    ingest_seconds: float | None

    def validate(self):
        total = sum(self.counts)
        if len(self.resync) != len(self.counts) or len(self.q_kinds) != len(self.counts):
            raise WireError("proposals: per-request lists differ in length")
        if self.tokens.shape != (total,):
            raise WireError("proposals: tokens do not match counts")
        kinds = set(self.q_kinds) - {"none"}
        if not kinds <= {"dense", "sparse"} or len(kinds) > 1:
            raise WireError(f"proposals: bad q_kinds {sorted(set(self.q_kinds))}")
        rows = sum(c for c, k in zip(self.counts, self.q_kinds) if k != "none")
        if kinds and (self.q_probs is None or self.q_probs.shape[:1] != (rows,)):
            raise WireError("proposals: q_probs missing or of the wrong shape")
        if "sparse" in kinds and (self.q_ids is None or self.q_ids.shape != self.q_probs.shape):
            raise WireError("proposals: sparse q needs q_ids shaped like q_probs")


@dataclass(kw_only=True)
class Release(Message):
    TYPE = "release"
    request_ids: list[str]


@dataclass(kw_only=True)
class Ping(Message):
    TYPE = "ping"
    call_id: int


@dataclass(kw_only=True)
class Pong(Message):
    TYPE = "pong"
    call_id: int
    drafter_kind: str
    block_size: int
    masks_grammars: bool  # whether constrained requests' drafts obey their grammars


TO_DRAFTER = channel(DraftRequest, Release, Ping)
TO_VERIFIER = channel(DraftReply, Pong)
