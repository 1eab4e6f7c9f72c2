"""Limits on what a request may carry, shared by the gateway (which checks them, without torch) and the
engine (which enforces them again)."""

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1  # every integer a request carries fits in int64
MIN_TEMPERATURE = 1e-5  # below it (0 included) decoding is greedy, as in vLLM and SGLang: float32 logits / T overflow


def is_int64(value) -> bool:
    """A Python int (not a bool) that fits in int64."""
    return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX
