"""Structured outputs: a request's constraint read from its body (OpenAI's response_format, vLLM's
structured_outputs and its older guided_* fields), turned into an llguidance grammar and compiled once under
bounds (size, time, llguidance's own limits) off the event loop, cached by its hash. The verify worker holds every
token to the grammar (shared/grammar.py, verify_worker/engine/grammar_masks.py)."""

import asyncio
import concurrent.futures
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
from tokenizers import Tokenizer

from gateway.schemas import ApiError
from shared.grammar import GRAMMAR_LIMITS, grammar_vocabulary, new_matcher

MAX_SPEC_BYTES = 256 * 1024  # a schema, regex or grammar larger than this is refused before it is compiled
COMPILE_TIMEOUT_S = 5.0  # a grammar whose compilation takes longer is refused (its thread finishes on its own)
CACHED_GRAMMARS = 256
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: no whitespace a model could repeat without end
VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class Constraint:
    kind: str  # json_schema, json_object, regex, choice, grammar
    spec: object  # the schema (a dict), the regex or grammar text, the choices (strings)
    param: str  # the request field it came from (for errors)

    def key(self) -> str:
        return hashlib.sha256(json.dumps([self.kind, self.spec], sort_keys=True).encode()).hexdigest()


def _response_format(value) -> Constraint | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       param="response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return Constraint("json_object", {"type": "object"}, "response_format")
    inner = value.get("json_schema")
    schema = inner.get("schema", {}) if isinstance(inner, dict) else None
    if not isinstance(schema, dict) or not isinstance(inner.get("strict", False), (bool, type(None))):
        raise ApiError(400, "'response_format.json_schema' must be an object with a 'schema' object (and optional "
                       "'name', 'description', 'strict')", param="response_format")
    return Constraint("json_schema", schema, "response_format")


def _vllm(kind: str, value, param: str) -> Constraint:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ApiError(400, f"'{param}' is not a JSON schema: {exc}", param=param) from None
        if not isinstance(value, dict):
            raise ApiError(400, f"'{param}' must be a JSON schema (an object)", param=param)
        return Constraint("json_schema", value, param)
    if kind == "json_object":
        return Constraint("json_object", {"type": "object"}, param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ApiError(400, f"'{param}' must be a non-empty list of strings", param=param)
        return Constraint("choice", list(value), param)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"'{param}' must be a non-empty string", param=param)
    return Constraint(kind, value, param)


def constraint_of(body: dict) -> Constraint | None:
    """The request's one constraint (None: free text); two at once, or a malformed one, is a 400."""
    found = []
    if body.get("response_format") is not None:
        found.append(_response_format(body["response_format"]))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise ApiError(400, "'structured_outputs' must be an object with one of " + ", ".join(VLLM_KINDS),
                           param="structured_outputs")
        for kind in VLLM_KINDS:
            if outputs.get(kind) not in (None, False):
                found.append(_vllm(kind, outputs[kind], f"structured_outputs.{kind}"))
    for kind in ("json", "regex", "choice", "grammar"):
        if body.get(f"guided_{kind}") is not None:
            found.append(_vllm(kind, body[f"guided_{kind}"], f"guided_{kind}"))
    found = [c for c in found if c is not None]
    if len(found) > 1:
        raise ApiError(400, f"one constraint at a time: the request has {', '.join(c.param for c in found)}",
                       param=found[1].param)
    return found[0] if found else None


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (ValueError, or llguidance's own errors, where it is malformed)."""
    kind, spec = constraint.kind, constraint.spec
    if kind in ("json_schema", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
    if kind == "lark":  # the server's own (a forced tool call's): never read as EBNF
        return llguidance.LLMatcher.grammar_from_lark(spec)
    if "::=" in spec:  # EBNF as vLLM's and llama.cpp's grammars write it
        return llguidance.grammar_from("gbnf", spec)
    return llguidance.LLMatcher.grammar_from_lark(spec)


def _compile(vocabulary, constraint: Constraint) -> str:
    """The grammar, compiled once to check it (raises ValueError with what is wrong)."""
    try:
        text = grammar_text(constraint)
    except Exception as exc:  # llguidance raises ValueError or its own types on a malformed spec
        raise ValueError(str(exc)) from None
    new_matcher(vocabulary, text)
    return text


class GrammarCompiler:
    """Constraints to grammars for one model: its vocabulary built once (in a thread, at start-up), each grammar
    compiled in a thread of its own pool with a time bound, the last CACHED_GRAMMARS results (and refusals) kept by
    the constraint's hash."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_ids: tuple[int, ...], workers: int = 2):
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        self.vocabulary = None if tokenizer is None else \
            self.pool.submit(grammar_vocabulary, tokenizer, vocab_size, eos_ids)
        self.cache: OrderedDict[str, str | ApiError] = OrderedDict()

    async def grammar(self, constraint: Constraint) -> str:
        """The compiled grammar's text; ApiError 400 naming what is wrong or which bound it passed."""
        size = len(json.dumps(constraint.spec)) if not isinstance(constraint.spec, str) else len(constraint.spec)
        if size > MAX_SPEC_BYTES:
            raise ApiError(400, f"'{constraint.param}' is {size} bytes; the limit is {MAX_SPEC_BYTES} bytes",
                           param=constraint.param)
        key = constraint.key()
        if key in self.cache:
            self.cache.move_to_end(key)
            found = self.cache[key]
            if isinstance(found, ApiError):
                raise found
            return found
        try:
            vocabulary = None if self.vocabulary is None else await asyncio.wrap_future(self.vocabulary)
        except Exception as exc:  # noqa: BLE001 - llguidance's or tokenizers' error, named to the client
            raise ApiError(400, f"structured outputs are off on this server: its tokenizer.json cannot be read as a "
                           f"grammar vocabulary ({exc})", param=constraint.param) from None
        if vocabulary is None:
            raise ApiError(400, "structured outputs need the target's tokenizer.json and an end-of-text token, and "
                           "this server has none", param=constraint.param)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self.pool, _compile, vocabulary, constraint)
        try:
            found = await asyncio.wait_for(asyncio.shield(work), COMPILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            found = ApiError(400, f"'{constraint.param}' did not compile within {COMPILE_TIMEOUT_S:g} s (the limit)",
                             param=constraint.param)
        except ValueError as exc:
            found = ApiError(400, f"'{constraint.param}' cannot be compiled: {exc} (limits: "
                             f"{', '.join(f'{k} {v}' for k, v in GRAMMAR_LIMITS.items())})", param=constraint.param)
        self.cache[key] = found
        if len(self.cache) > CACHED_GRAMMARS:
            self.cache.popitem(last=False)
        if isinstance(found, ApiError):
            raise found
        return found
