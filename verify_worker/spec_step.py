"""What a decode step tells the speculation policy and what it gets back: one plan before drafting, one outcome
after committing (AdaptiveSpeculation.plan / record). Plain data: the engine fills them, the policy reads them."""

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class RowNeed:
    """A running request as the policy sees it before a step."""

    request_id: str
    asks_drafts: bool  # it set num_speculative_tokens > 0 itself: its row drafts every step
    refuses_drafts: bool  # it set num_speculative_tokens = 0: its row never drafts
    seeded_sampled: bool  # sampled with a seed: its draws depend on the schedule
    greedy: bool


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """What a decode step does: whether it speculates, the rows pinned to drafting whatever the policy prefers,
    the rows that draft, and whether it is a scored probe (the free rows' drafts kept and scored later against
    what plain steps commit, not verified). policy_plain: the policy chose plain decoding for the free rows.
    drafts: a narrower draft count for the free rows (verify_worker/draft_widths.py)."""

    speculate: bool
    pinned: list[bool]
    drafting: list[bool]
    scored: bool = False
    policy_plain: bool = False
    drafts: int | None = None  # the most drafts a free (not pinned) row asks for (None: the full block)

    @classmethod
    def every_row(cls, rows: int) -> "StepPlan":
        """Without a policy (--spec-policy always): every row drafts what it may."""
        return cls(speculate=True, pinned=[True] * rows, drafting=[True] * rows)


@dataclass(frozen=True, kw_only=True)
class StepOutcome:
    """What a decode step did, for the policy: per row the drafts it obtained, the tokens it committed
    (and which), whether it finished; the step's decode seconds and the mode they measure (None: neither, for a
    step that is not pure), and a scored probe's drafts by request."""

    request_ids: list[str]
    counts: list[int]
    committed: list[int]
    new_tokens: list[list[int]]
    finished: list[bool]
    seconds: float
    timed: bool | None
    probe_drafts: dict[str, list[int]] = field(default_factory=dict)
