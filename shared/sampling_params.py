"""The sampling parameters of a request, without torch: the gateway builds them, the wire carries them nested in a
submit, the engine and the drafter sample with them (shared/sampling.py)."""

import math
from dataclasses import dataclass

from shared.errors import RequestError
from shared.request_limits import MIN_TEMPERATURE, is_int64


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below MIN_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None

    def __post_init__(self):
        if not _finite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}",
                               param="temperature")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if not is_int64(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer from 0 to 2**63 - 1, got {self.top_k!r}", param="top_k")
        if self.seed is not None and not is_int64(self.seed):
            raise RequestError(f"seed must be an integer from -2**63 to 2**63 - 1, got {self.seed!r}", param="seed")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE
