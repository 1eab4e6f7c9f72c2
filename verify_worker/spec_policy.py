"""When speculation pays: a step-by-step choice between speculative and plain decoding from measured rates.

Both modes are lossless step by step, and the choice depends only on what has already happened, so any schedule
of them keeps the output exact (greedy: the same tokens; sampling: the same distribution). This policy runs the
mode with the higher measured rate (tokens committed per second per request) for the batch size at hand, and
keeps measuring the other one: every `period` steps it spends `probe` steps in the mode it did not choose, so a
drafter that starts to pay (or stops) is noticed. Plain decoding is a real mode of the same engine (every
request drafts 0 tokens), not a fallback.
"""

from dataclasses import dataclass, field


def batch_bucket(batch_size: int) -> int:
    """Batch sizes measured together: 1, 2, 3-4, 5-8, 9-16, ... (the next power of two)."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class AdaptiveSpeculation:
    period: int = 64  # steps between probes of the mode not chosen
    probe: int = 4  # steps each probe lasts
    weight: float = 0.25  # weight of a new observation in the moving averages
    rates: dict[tuple[int, bool], float] = field(default_factory=dict)  # (bucket, speculative) -> tokens/s/request
    steps: int = 0

    def speculate(self, batch_size: int) -> bool:
        """Whether the next decode step of a batch of this size drafts."""
        bucket = batch_bucket(batch_size)
        spec, plain = self.rates.get((bucket, True)), self.rates.get((bucket, False))
        if spec is None:
            return True  # measure speculation first, then plain decoding
        if plain is None:
            return False
        preferred = spec >= plain
        probing = self.steps % self.period >= self.period - self.probe
        return preferred != probing

    def observe(self, batch_size: int, speculative: bool | None, committed_tokens: int, seconds: float) -> None:
        """One decode step: how many tokens the batch committed, in how long; speculative None for a step that
        measures neither mode (it still counts towards the probe schedule)."""
        self.steps += 1
        if speculative is None or seconds <= 0 or batch_size <= 0:
            return
        key = (batch_bucket(batch_size), speculative)
        rate = committed_tokens / seconds / batch_size
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else (1 - self.weight) * old + self.weight * rate

    def preferred_mode(self, batch_size: int) -> str | None:
        """"speculative" or "plain" once both were measured for this batch size (for logs and tests)."""
        bucket = batch_bucket(batch_size)
        spec, plain = self.rates.get((bucket, True)), self.rates.get((bucket, False))
        if spec is None or plain is None:
            return None
        return "speculative" if spec >= plain else "plain"
