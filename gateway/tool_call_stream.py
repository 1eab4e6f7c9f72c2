"""Generated text -> content and tool calls, fed in pieces of any size (a step may commit several tokens): text
before a call's start tag is content, never part of a tag; a call goes out as one delta with its id and whole name,
then its arguments in pieces as they are generated. parse_whole reads a whole output the same way, so a
non-streamed answer's arguments are the streamed pieces joined. Pure text: no torch, no tokens."""

import json
import re
import uuid
from dataclasses import dataclass, field

from gateway.text_tags import partial_tag_suffix
from gateway.tool_calls import GlmFormat, ToolRequest, schema_says_string

# What a call reader gives back: ("name", name), ("arguments", a piece of the arguments' JSON), or ("content",
# text) for a call that turned out to be none (its text given back whole).
Piece = tuple[str, str]


class HermesCallReader:
    """{"name": ..., "arguments": {...}} between the tags: the name once its string has closed and the arguments'
    object has begun; the object's raw text then, up to its closing brace. A body of another shape (arguments
    first, arguments as a JSON string) is read whole when the call closes."""

    HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')

    def __init__(self, fmt, tools: ToolRequest):
        self.fmt, self.tools = fmt, tools
        self.raw = ""  # the call's text so far
        self.named = False
        self.start = self.scanned = 0  # where the arguments' object begins in body; how far it was read
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False

    def feed(self, text: str, closed: bool) -> list[Piece]:
        self.raw += text
        out: list[Piece] = []
        if not self.named:
            head = self.HEAD.match(self.raw)
            if head is None:
                return self._whole() if closed else out
            self.named, self.start = True, head.end()
            self.scanned = self.start
            out.append(("name", json.loads(head.group(1))))
        begin = self.scanned
        while self.scanned < len(self.raw) and not self.done:
            self._scan(self.raw[self.scanned])
            self.scanned += 1
        if self.scanned > begin:
            out.append(("arguments", self.raw[begin:self.scanned]))
        return out

    def _scan(self, char: str) -> None:
        """One character of the arguments' JSON: strings, escapes and nesting followed to the object's end."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            self.done = self.depth == 0

    def _whole(self) -> list[Piece]:
        parsed = self.fmt.parse(self.raw.strip(), self.tools)
        if parsed is None:
            return [("content", self.fmt.start + self.raw + self.fmt.end)]
        return [("name", parsed[0]), ("arguments", parsed[1])]


class GlmCallReader:
    """name<arg_key>k</arg_key><arg_value>v</arg_value>... between the tags (GlmFormat): the name once a tag or a
    line break follows it; the arguments as one JSON object written as the pairs arrive: a string value (by the
    tool's schema) escaped piece by piece while it is generated, any other value whole at its </arg_value> (JSON,
    or its raw text as a string where it does not parse)."""

    KEY, VALUE, END_KEY, END_VALUE = "<arg_key>", "<arg_value>", "</arg_key>", "</arg_value>"

    def __init__(self, fmt: GlmFormat, tools: ToolRequest):
        self.fmt, self.tools = fmt, tools
        self.raw = ""  # every text fed (given back as content where no name comes)
        self.pending = ""  # text not yet read
        self.void = False  # a tag came before any name: no call, its text is content when it closes
        self.name: str | None = None
        self.properties: dict = {}
        self.state = "key"  # key: before a pair; value: waiting for <arg_value>; string / json: inside a value
        self.key = ""
        self.pairs = 0

    def feed(self, text: str, closed: bool) -> list[Piece]:
        self.raw += text
        self.pending += text
        out: list[Piece] = []
        if self.name is None:
            bound = re.search(r"<|\S\s*\n", self.pending)  # the name ends at a tag or at its line's end
            if bound is None and not closed:
                return out
            end = len(self.pending) if bound is None else bound.start() + (bound.group() != "<")
            name = self.pending[:end].strip()
            self.void = self.void or not name
            if self.void:
                return [("content", self.fmt.start + self.raw + self.fmt.end)] if closed else out
            self.name, self.pending = name, self.pending[end:]
            spec = self.tools.spec(name)
            self.properties = (spec.parameters.get("properties") or {}) if spec else {}
            out.append(("name", name))
        while self._step(out, closed):
            pass
        if closed:
            if self.state == "string":
                out.append(("arguments", '"'))
            out.append(("arguments", "}" if self.pairs else "{}"))
        return out

    def _step(self, out: list[Piece], closed: bool) -> bool:
        """Read what pending allows in the current state; whether to read on."""
        if self.state in ("key", "value"):
            tag = self.KEY if self.state == "key" else self.VALUE
            at = self.pending.find(tag)
            if at < 0:  # text between tags is not part of the call
                self.pending = self.pending[len(self.pending) - partial_tag_suffix(self.pending, tag):]
                return False
            if self.state == "key":
                close = self.pending.find(self.END_KEY, at)
                if close < 0:
                    return False
                self.key = self.pending[at + len(tag):close].strip()
                self.pending, self.state = self.pending[close + len(self.END_KEY):], "value"
                return True
            self.pending = self.pending[at + len(tag):]
            self.state = "string" if schema_says_string(self.properties.get(self.key)) else "json"
            if self.state == "string":
                out.append(("arguments", self._opening() + '"'))
            return True
        close = self.pending.find(self.END_VALUE)
        if self.state == "string":
            keep = 0 if close >= 0 or closed else partial_tag_suffix(self.pending, self.END_VALUE)
            text = self.pending[:close] if close >= 0 else self.pending[:len(self.pending) - keep]
            if text:
                out.append(("arguments", json.dumps(text, ensure_ascii=False)[1:-1]))
            if close < 0:
                self.pending = self.pending[len(text):]
                return False
            out.append(("arguments", '"'))
        else:
            if close < 0 and not closed:
                return False
            raw = self.pending if close < 0 else self.pending[:close]
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = raw
            out.append(("arguments", self._opening() + json.dumps(value, ensure_ascii=False)))
            if close < 0:
                self.pending, self.state = "", "key"
                return False
        self.pending, self.state = self.pending[close + len(self.END_VALUE):], "key"
        return True

    def _opening(self) -> str:
        """The text before a pair's value: the object's brace or a comma, then its key."""
        self.pairs += 1
        return ("{" if self.pairs == 1 else ", ") + json.dumps(self.key, ensure_ascii=False) + ": "


@dataclass
class CallDelta:
    """One piece of a stream: content text, a call's start (its index, id and name, arguments ""), or a piece of
    a started call's arguments (its index and the piece)."""

    index: int | None = None  # the call's index among this choice's calls (None: content)
    content: str = ""
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def as_openai(self) -> dict:
        call: dict = {"index": self.index}
        if self.id is not None:
            call.update(id=self.id, type="function")
        function = {}
        if self.name is not None:
            function["name"] = self.name
        if self.arguments is not None:
            function["arguments"] = self.arguments
        call["function"] = function
        return call


@dataclass
class ToolCallStream:
    """A choice's text in pieces -> CallDeltas. A call still open at the end is closed as far as its format
    allows (a GLM call's object is closed; a hermes call's arguments stay as generated); an open call whose name
    never came is given back as content."""

    fmt: object
    tools: ToolRequest
    buffer: str = ""
    reader: object = None  # the open call's reader (None: outside a call)
    calls: list = field(default_factory=list)  # [id, name, arguments so far] of the calls started

    def feed(self, text: str) -> list[CallDelta]:
        self.buffer += text
        out: list[CallDelta] = []
        while True:
            if self.reader is None:
                at = self.buffer.find(self.fmt.start)
                if at < 0:
                    keep = partial_tag_suffix(self.buffer, self.fmt.start)
                    if len(self.buffer) > keep:
                        out.append(CallDelta(content=self.buffer[:len(self.buffer) - keep]))
                        self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                if at:
                    out.append(CallDelta(content=self.buffer[:at]))
                self.buffer = self.buffer[at + len(self.fmt.start):]
                self.reader = (GlmCallReader if isinstance(self.fmt, GlmFormat) else HermesCallReader)(
                    self.fmt, self.tools)
            end = self.buffer.find(self.fmt.end)
            if end < 0:
                keep = partial_tag_suffix(self.buffer, self.fmt.end)
                text, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                out += self._deltas(self.reader.feed(text, closed=False))
                return out
            text, self.buffer = self.buffer[:end], self.buffer[end + len(self.fmt.end):]
            out += self._deltas(self.reader.feed(text, closed=True))
            self.reader = None

    def finish(self) -> list[CallDelta]:
        """What is left at the end: an open call closed (or given back as content), a held-back piece as content."""
        out, rest = [], self.buffer
        self.buffer = ""
        if self.reader is not None:
            started = self.calls and self.calls[-1][3] is self.reader
            if started:
                out = self._deltas(self.reader.feed(rest, closed=True))
                rest = ""
            else:
                rest = self.fmt.start + self.reader.raw + rest
            self.reader = None
        return out + ([CallDelta(content=rest)] if rest else [])

    def _deltas(self, pieces: list[Piece]) -> list[CallDelta]:
        out = []
        for kind, text in pieces:
            if kind == "content":
                out.append(CallDelta(content=text))
            elif kind == "name":
                call_id = "call_" + uuid.uuid4().hex[:24]
                self.calls.append([call_id, text, "", self.reader])
                out.append(CallDelta(index=len(self.calls) - 1, id=call_id, name=text, arguments=""))
            elif text:
                self.calls[-1][2] += text
                out.append(CallDelta(index=len(self.calls) - 1, arguments=text))
        return out

    @property
    def call_list(self) -> list[tuple[str, str, str]]:
        """(id, name, arguments) of the calls started so far."""
        return [(call_id, name, arguments) for call_id, name, arguments, _ in self.calls]


def parse_whole(fmt, tools: ToolRequest, text: str) -> tuple[str, list[tuple[str, str, str]]]:
    """A whole output: (its content, its calls as (id, name, arguments))."""
    stream = ToolCallStream(fmt, tools)
    deltas = stream.feed(text) + stream.finish()
    return "".join(d.content for d in deltas if d.index is None), stream.call_list
