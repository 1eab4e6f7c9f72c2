"""Property-based fuzzing of request bodies against a running server (hypothesis): used by
tests/test_server_poison.py and by benchmarks/fault_drill.py.

Bodies are drawn field by field from the gateway's own field table (gateway/request_fields.py): each field
inside its documented range, then up to two fields (or an unknown one) replaced by an adversarial value (the
int64 and float edges, out-of-range numbers, wrong types); plus broken JSON and non-object bodies. Generation is kept cheap (a few tokens) so that thousands
of bodies run in a minute or two. The property: no response is a 5xx, no connection is reset, and a 200 stream
carries no error event.
"""

import json

import httpx
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from gateway.request_fields import CHAT, COMPLETIONS, fields_of

EDGE_INTEGERS = [2**63 - 1, 2**63, 2**64, 10**30, -2**63, -2**63 - 1, -1, 0, 1]
EDGE_FLOATS = [1e308, -1e308, 5e-324, -5e-324, -0.0, 0.0, 1e-6, 2.0000001, 1.0]
JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=8), st.lists(st.integers(-3, 3), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def _valid_scalar(spec) -> st.SearchStrategy | None:
    """Values inside a scalar field's documented range (small ones, so that valid bodies stay cheap)."""
    if spec.only is not None:
        return st.just(spec.only)
    if spec.json_type == "integer":
        low = spec.minimum if spec.minimum is not None else -2**63
        high = spec.maximum if spec.maximum is not None else 2**63 - 1
        return st.one_of(st.integers(max(low, -3), min(high, max(low, -3) + 6)), st.sampled_from([low, high]))
    if spec.json_type == "number":
        low = spec.minimum if spec.minimum is not None else spec.exclusive_minimum
        high = spec.maximum
        return st.floats(low, high, exclude_min=spec.exclusive_minimum is not None, allow_nan=False)
    if spec.json_type == "boolean":
        return st.booleans()
    return None


TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
VALID_COMPLEX = {
    "prompt": st.one_of(TEXT.filter(bool), st.lists(st.integers(0, 257), min_size=1, max_size=5),
                        st.lists(TEXT.filter(bool), min_size=1, max_size=2)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                "content": TEXT}), min_size=1, max_size=3),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop_token_ids": st.lists(st.integers(0, 257), max_size=3),
}
ADVERSARIAL = st.one_of(
    st.sampled_from(EDGE_INTEGERS), st.sampled_from(EDGE_FLOATS), JUNK,
    st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.integers(-2**65, 2**65), max_size=3), st.text(max_size=20))


def body_strategy(endpoint: str, model: str) -> st.SearchStrategy:
    """A body valid field by field (fields drawn inside their documented ranges), then 0-2 fields (known or
    unknown) replaced by adversarial values: edges, out-of-range numbers, wrong types."""
    fields = fields_of(endpoint)
    optional = {}
    for name, spec in fields.items():
        strategy = VALID_COMPLEX[name] if name in VALID_COMPLEX else _valid_scalar(spec)
        if strategy is not None and name not in ("prompt", "messages"):
            optional[name] = strategy
    required = {"model": st.just(model), "max_tokens": st.integers(0 if endpoint == COMPLETIONS else 1, 6),
                ("prompt" if endpoint == COMPLETIONS else "messages"):
                    VALID_COMPLEX["prompt" if endpoint == COMPLETIONS else "messages"]}
    optional["n"] = st.integers(1, 3)
    names = sorted(fields) + ["unknown_field"]
    mutations = st.lists(st.tuples(st.sampled_from(names), ADVERSARIAL), max_size=2)
    return st.builds(lambda base, extra, changes: {**base, **extra, **dict(changes)},
                     st.fixed_dictionaries(required), st.fixed_dictionaries({}, optional=optional), mutations)


def raw_strategy() -> st.SearchStrategy:
    """Bodies that are not a JSON object: broken JSON, other JSON values, non-finite literals, huge numbers."""
    return st.one_of(st.binary(max_size=40), st.sampled_from([
        b"", b"{", b"[]", b"null", b"42", b'"x"', b'{"prompt": NaN}', b'{"temperature": Infinity, "prompt": "x"}',
        b'{"top_k": ' + b"9" * 5000 + b', "prompt": "x"}', b"[" * 100000 + b"]" * 100000,
        b'{"prompt": "\\ud800"}', b'{"prompt": "x", "max_tokens": 1e400}']))


def send(client: httpx.Client, url: str, endpoint: str, payload) -> tuple[int, bool]:
    """(status, whether a 200 stream carried an error event); raises on a reset connection."""
    path = "/v1/completions" if endpoint == COMPLETIONS else "/v1/chat/completions"
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    with client.stream("POST", url + path, content=content, headers={"content-type": "application/json"}) as response:
        text = response.read().decode("utf-8", "replace")
    failed_stream = response.status_code == 200 and "data: {\"error\"" in text
    return response.status_code, failed_stream


def fuzz(url: str, model: str, count: int, seed_value: int = 0) -> dict:
    """Sends `count` random bodies (both endpoints); returns the status counts. Fails (with hypothesis's
    smallest failing body) on a 5xx, a reset connection or a 200 stream that ends with an error."""
    outcome = {"codes": {}, "server_errors": 0, "connection_errors": 0, "sent": 0}
    client = httpx.Client(timeout=60)
    payloads = st.one_of(
        st.tuples(st.just(COMPLETIONS), body_strategy(COMPLETIONS, model)),
        st.tuples(st.just(CHAT), body_strategy(CHAT, model)),
        st.tuples(st.sampled_from([COMPLETIONS, CHAT]), raw_strategy()),
    )

    @seed(seed_value)
    @settings(max_examples=count, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(payloads)
    def one(payload):
        endpoint, body = payload
        try:
            status, failed_stream = send(client, url, endpoint, body)
        except httpx.TransportError:
            outcome["connection_errors"] += 1
            raise
        outcome["sent"] += 1
        outcome["codes"][status] = outcome["codes"].get(status, 0) + 1
        outcome["server_errors"] += status >= 500 or failed_stream
        assert status < 500 and not failed_stream, (status, body)

    try:
        one()
    finally:
        client.close()
    return outcome
