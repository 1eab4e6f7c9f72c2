"""Request validation at the gateway: every field the engine computes with is checked against the one field table
(int64 integers, finite numbers, the documented ranges) with a 400 naming it, and /openapi.json documents both
request bodies from that same table. No server, no torch."""

import asyncio
import json
import math
import time

import pytest
from fastapi.testclient import TestClient

from gateway.app import GatewaySettings, create_app
from gateway.request_fields import CHAT, COMPLETIONS, ENDPOINTS, FIELDS, INT64_MAX, INT64_MIN, fields_of
from gateway.schemas import ApiError, parse_chat, parse_completion, parse_json
from gateway.tokenization import TextCodec
from gateway.verify_client import UnencodableRequest, VerifyClient, encode_submit
from shared.byte_tokenizer import write_byte_tokenizer
from shared.errors import RequestError
from shared.generation_request import GenerationRequest
from shared.sampling_params import SamplingParams

MODEL = "tiny"
VOCAB = 258  # the byte tokenizer: 256 bytes and 2 special tokens
PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
MINIMAL = {COMPLETIONS: {"prompt": "x"}, CHAT: {"messages": [{"role": "user", "content": "hi"}]}}


def parse(endpoint: str, body: dict):
    parser = parse_completion if endpoint == COMPLETIONS else parse_chat
    return parser(body, MODEL, VOCAB, 64)  # at most 64 prompts of a batch, or messages


def refusal(endpoint: str, body: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(endpoint, {**MINIMAL[endpoint], **body})
    return caught.value


def raw_refusal(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_json(raw)
    return caught.value


def assert_names(error: ApiError, name: str) -> None:
    assert error.status == 400 and error.param == name and f"'{name}'" in error.message, error.message
    assert error.body()["error"]["type"] == "invalid_request_error"


def integer_fields():
    return [(endpoint, spec) for endpoint in ENDPOINTS for spec in fields_of(endpoint).values()
            if spec.json_type == "integer"]


def test_the_table_covers_every_integer_the_engine_uses():
    names = {spec.name for _, spec in integer_fields()}
    assert {"top_k", "seed", "num_speculative_tokens", "n", "logprobs", "top_logprobs", "max_tokens",
            "max_completion_tokens", "best_of"} <= names
    assert all(INT64_MIN <= spec.minimum and spec.maximum <= INT64_MAX for _, spec in integer_fields())
    for endpoint in ENDPOINTS:  # one entry per field and endpoint
        assert len([spec for spec in FIELDS if endpoint in spec.endpoints]) == len(fields_of(endpoint))


@pytest.mark.parametrize("endpoint,spec", integer_fields(), ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("value", [2**63, 2**64, 10**30, -2**63 - 1])
def test_integers_beyond_int64_are_refused_naming_the_field(endpoint, spec, value):
    assert_names(refusal(endpoint, {spec.name: value}), spec.name)


@pytest.mark.parametrize("endpoint,spec", [(e, s) for e, s in integer_fields() if s.minimum > INT64_MIN],
                         ids=lambda v: getattr(v, "name", v))
def test_most_negative_int64_is_refused_where_negative_means_nothing(endpoint, spec):
    assert_names(refusal(endpoint, {spec.name: -2**63}), spec.name)


def test_seed_takes_the_whole_int64_range():
    assert parse(COMPLETIONS, {"prompt": "x", "seed": -2**63}).seed == -2**63
    assert parse(COMPLETIONS, {"prompt": "x", "seed": 2**63 - 1}).seed == 2**63 - 1


def test_num_speculative_tokens_range():
    assert parse(COMPLETIONS, {"prompt": "x", "num_speculative_tokens": 0}).num_speculative_tokens == 0
    assert parse(COMPLETIONS, {"prompt": "x", "num_speculative_tokens": 2**63 - 1}).num_speculative_tokens == \
        2**63 - 1
    assert_names(refusal(COMPLETIONS, {"num_speculative_tokens": -1}), "num_speculative_tokens")


@pytest.mark.parametrize("top_k,sent", [(-1, 0), (0, 0), (1, 1), (VOCAB - 1, VOCAB - 1), (VOCAB, 0),
                                        (VOCAB + 1, 0), (2**63 - 1, 0)])
def test_top_k_off_values_and_vocabulary_sized_cuts_are_sent_as_no_cut(top_k, sent):
    assert parse(COMPLETIONS, {"prompt": "x", "top_k": top_k}).top_k == sent
    assert parse(CHAT, {**MINIMAL[CHAT], "top_k": top_k}).top_k == sent


def test_top_k_below_minus_one_is_refused():
    assert_names(refusal(COMPLETIONS, {"top_k": -2}), "top_k")


@pytest.mark.parametrize("value,expected", [(5e-324, 0.0), (1e-6, 0.0), (-0.0, 0.0), (0, 0.0), (1e-5, 1e-5),
                                            (0.7, 0.7), (2, 2.0)])
def test_tiny_temperatures_are_greedy(value, expected):
    temperature = parse(COMPLETIONS, {"prompt": "x", "temperature": value}).temperature
    assert temperature == expected and math.copysign(1.0, temperature) == 1.0 and type(temperature) is float


@pytest.mark.parametrize("value,expected", [(5e-324, 5e-324), (1, 1.0), (0.5, 0.5)])
def test_top_p_takes_any_positive_value_up_to_one(value, expected):
    assert parse(COMPLETIONS, {"prompt": "x", "top_p": value}).top_p == expected


@pytest.mark.parametrize("name,value", [
    ("temperature", 1e308), ("temperature", -5e-324), ("temperature", 2.0000001), ("temperature", 10**30),
    ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 1e308), ("top_p", -0.0), ("top_p", 0), ("top_p", float("nan")), ("top_p", float("-inf")),
    ("presence_penalty", float("nan")), ("presence_penalty", float("inf")), ("frequency_penalty", float("-inf")),
    ("frequency_penalty", 10**30),
])
def test_numbers_out_of_range_or_not_finite_are_refused(name, value):
    for endpoint in ENDPOINTS:
        assert_names(refusal(endpoint, {name: value}), name)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("name", ["temperature", "top_p", "presence_penalty", "seed", "top_k"])
def test_non_json_number_literals_are_refused_naming_the_field(literal, name):
    error = raw_refusal(f'{{"prompt": "x", "{name}": {literal}}}'.encode())
    assert_names(error, name)
    assert error.code == "invalid_json" and literal in error.message


def test_non_json_literals_anywhere_are_refused():
    assert_names(raw_refusal(b'{"prompt": [1, 2, [3, NaN]]}'), "prompt")
    assert_names(raw_refusal(b'{"user": {"a": [Infinity]}}'), "user")  # a field we ignore: still not JSON


def test_overflowing_number_literals_are_not_finite():
    body = parse_json(b'{"prompt": "x", "temperature": 1e400}')  # valid JSON that Python reads as inf
    assert_names(refusal(COMPLETIONS, body), "temperature")


def test_integers_too_long_to_read_and_deep_nesting_are_invalid_json():
    for raw in [b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", b'{"prompt": "x", "n": -' + b"9" * 10**5 + b"}",
                b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                b'{"prompt": "x", "user": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001]:
        error = raw_refusal(raw)
        assert error.status == 400 and error.code == "invalid_json" and error.param is None


def test_long_values_are_shortened_in_messages():
    error = refusal(COMPLETIONS, parse_json(b'{"seed": 1' + b"0" * 4000 + b"}"))
    assert_names(error, "seed")
    assert len(error.message) < 200
    assert_names(refusal(COMPLETIONS, {"n": "x" * 10**6}), "n")
    assert len(refusal(COMPLETIONS, {"n": "x" * 10**6}).message) < 200


def test_deeply_nested_values_in_scalar_fields_are_refused():
    nested = json.loads("[" * 900 + "]" * 900)
    assert_names(refusal(COMPLETIONS, {"n": nested}), "n")


@pytest.mark.parametrize("endpoint,body,param", [
    (COMPLETIONS, {"prompt": "a\ud800b"}, "prompt"),
    (COMPLETIONS, {"prompt": ["ok", "\udfff"]}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    (COMPLETIONS, {"stream_options": {"include_usage": "yes"}}, "stream_options"),
    (COMPLETIONS, {"stream_options": [1]}, "stream_options"),
])
def test_malformed_text_and_options_are_refused(endpoint, body, param):
    with pytest.raises(ApiError) as caught:
        parse(endpoint, {**MINIMAL[endpoint], **body})
    assert caught.value.status == 400 and caught.value.param == param


def test_neutral_values_of_unsupported_parameters_are_accepted():
    neutral = {"presence_penalty": -0.0, "frequency_penalty": 0, "best_of": 1, "logit_bias": {}, "suffix": "",
               "tools": [], "tool_choice": "auto", "response_format": {"type": "text"}}
    for endpoint in ENDPOINTS:
        parse(endpoint, {**MINIMAL[endpoint], **neutral})
    for name, value in [("presence_penalty", 0.5), ("best_of", 2), ("best_of", 0)]:
        assert_names(refusal(COMPLETIONS, {name: value}), name)


class RecordingBody(dict):
    """A request body that records which fields the parser reads."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_parser_reads_only_fields_of_the_table(endpoint):
    body = RecordingBody(MINIMAL[endpoint])
    parse(endpoint, body)
    assert body.read <= set(fields_of(endpoint)), body.read - set(fields_of(endpoint))
    scalars = {name for name, spec in fields_of(endpoint).items() if spec.json_type in ("integer", "number",
                                                                                         "boolean")}
    assert scalars <= body.read  # every documented scalar is checked


@pytest.fixture
def app(tmp_path):
    write_byte_tokenizer(tmp_path)
    settings = GatewaySettings(MODEL, VOCAB, 512, "tcp://127.0.0.1:9", "tcp://127.0.0.1:9", dead_after_s=600)
    application = create_app(settings, TextCodec.from_folder(tmp_path))
    yield application
    asyncio.run(application.state.client.close())


@pytest.fixture
def document(app):
    response = TestClient(app).get("/openapi.json")  # no `with`: the lifespan (the verify channel) is not run
    assert response.status_code == 200
    return response.json()


def body_schema_of(document: dict, endpoint: str) -> dict:
    request_body = document["paths"][PATHS[endpoint]]["post"]["requestBody"]
    assert request_body["required"] is True
    return request_body["content"]["application/json"]["schema"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_openapi_documents_every_field_with_its_type_and_bounds(document, endpoint):
    schema = body_schema_of(document, endpoint)
    fields = fields_of(endpoint)
    assert set(schema["properties"]) == set(fields)
    assert schema["required"] == ["prompt" if endpoint == COMPLETIONS else "messages"]
    for name, spec in fields.items():
        documented = schema["properties"][name]
        assert documented["description"] == spec.description
        assert "type" in documented or "anyOf" in documented or "enum" in documented, name
        if spec.json_type in ("integer", "number", "boolean"):
            assert documented["type"] == spec.json_type
        if spec.json_type == "integer":
            assert documented["format"] == "int64" and documented["minimum"] == spec.minimum
            if "maximum" in documented:
                assert documented["maximum"] == spec.maximum
            else:  # 2**63 - 1 is not a double: the bound is written as the exclusive 2**63
                assert documented["exclusiveMaximum"] == spec.maximum + 1 == 2**63
    seed, top_k = schema["properties"]["seed"], schema["properties"]["top_k"]
    assert seed["minimum"] == -2**63 and seed["exclusiveMaximum"] == 2**63 and "maximum" not in seed
    assert top_k["minimum"] == -1 and top_k["exclusiveMaximum"] == 2**63 and top_k["default"] == 0
    assert schema["properties"]["n"]["maximum"] == 64
    assert schema["properties"]["temperature"]["minimum"] == 0 and schema["properties"]["temperature"]["maximum"] == 2
    assert "1e-05" in schema["properties"]["temperature"]["description"]
    assert schema["properties"]["top_p"]["exclusiveMinimum"] == 0 and schema["properties"]["top_p"]["maximum"] == 1


def test_the_two_bodies_differ_where_the_endpoints_do(document):
    completion, chat = body_schema_of(document, COMPLETIONS), body_schema_of(document, CHAT)
    assert completion["properties"]["logprobs"]["type"] == "integer" and chat["properties"]["logprobs"]["type"] == \
        "boolean"
    assert completion["properties"]["max_tokens"]["minimum"] == 0 and chat["properties"]["max_tokens"]["minimum"] == 1
    assert "top_logprobs" in chat["properties"] and "top_logprobs" not in completion["properties"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_documented_examples_pass_the_parser(document, endpoint):
    examples = body_schema_of(document, endpoint)["examples"]
    assert examples
    for example in examples:
        params = parse(endpoint, parse_json(json.dumps(example).encode()))
        assert params.temperature == example["temperature"] and params.max_tokens == example["max_tokens"]


def test_the_interactive_docs_stay_off(app):
    client = TestClient(app)
    assert client.get("/docs").status_code == 404 and client.get("/redoc").status_code == 404


@pytest.mark.parametrize("raw", [
    b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}",
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b'{"prompt": "x", "top_k": 18446744073709551616}',
    b'{"prompt": "\\ud800"}', b'{"prompt": "x", "num_speculative_tokens": 9223372036854775808}',
    b'{"prompt": "x", "stop": ["\\udc00"], "n": "\\ud800"}',
])
def test_bad_bodies_get_an_openai_400_over_http(app, raw):
    response = TestClient(app).post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_an_unknown_model_with_a_lone_surrogate_or_a_long_name_is_a_404(app):
    for name in ["\\ud800", "m" * 10**5]:
        raw = f'{{"model": "{name}", "prompt": "x"}}'.encode()
        response = TestClient(app).post("/v1/completions", content=raw)
        assert response.status_code == 404 and len(response.json()["error"]["message"]) < 200
    error = ApiError(400, "bad \ud800 text")
    assert error.message == "bad \\ud800 text"


def submit(token: int) -> GenerationRequest:
    return GenerationRequest(request_id="r1", prompt_ids=[1, token], max_tokens=4, sampling=SamplingParams(seed=7),
                             stop_token_ids=[256])


def test_an_unencodable_request_names_its_field_and_registers_no_queue():
    with pytest.raises(UnencodableRequest) as caught:
        encode_submit(submit(2**64))
    assert caught.value.field == "prompt_ids" and "prompt_ids" in str(caught.value)
    assert isinstance(caught.value, ValueError)
    with pytest.raises(RequestError):  # a seed past int64 cannot even be built: the sampling parameters check it
        SamplingParams(seed=2**64)

    async def scenario():
        client = VerifyClient("tcp://127.0.0.1:9", "tcp://127.0.0.1:9")
        try:
            with pytest.raises(UnencodableRequest):
                await client.submit(submit(-2**63 - 1))
            return dict(client.queues)
        finally:
            await client.close()

    assert asyncio.run(scenario()) == {}


def test_an_unencodable_choice_is_a_400_and_releases_the_choices_already_sent(app):
    client = app.state.client
    sent, aborted = [], []

    async def fake_submit(message, queue=None):
        if sent:
            raise UnencodableRequest("the request cannot be sent to the verify worker: 'seed': out of range", "seed")
        sent.append(message.request_id)
        client.queues[message.request_id] = queue
        return queue

    async def fake_abort(request_id):
        aborted.append(request_id)
        client.queues.pop(request_id, None)

    client.submit, client.abort = fake_submit, fake_abort
    client.last_seen = time.monotonic()  # alive without a verify worker
    response = TestClient(app).post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "seed" and "seed" in response.json()["error"]["message"]
    assert aborted == sent and len(sent) == 1 and client.queues == {}
