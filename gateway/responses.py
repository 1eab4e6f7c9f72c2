"""A request's answer from its choices' events: one JSON body (collect) or a stream of SSE chunks (stream), in
OpenAI's completion and chat shapes, with text, token ids, log-probabilities and usage as asked."""

import json
import logging
import time

from fastapi.responses import Response

from gateway.choices import ChoiceSet, Disconnected, Failed
from gateway.logprobs import TextOffsets, chat_logprobs, completion_logprobs, joined, prompt_logprobs
from gateway.schemas import ApiError, Prompt
from gateway.tokenization import TextCodec
from gateway.reasoning import ReasoningSplit
from gateway.tool_call_stream import ToolCallStream
from gateway.turn import Turn, event_logprobs, meta_info, usage


class Responses:
    """Writes the answers of one served model."""

    def __init__(self, codec: TextCodec, model_name: str, log: logging.Logger, call_format=None):
        self.codec, self.model_name, self.log = codec, model_name, log
        self.call_format = call_format  # how tool calls are read from a chat answer (tool_calls.py)

    def reader(self, turn: Turn) -> "ChatReader":
        return ChatReader(turn, self.call_format)

    def message_of(self, turn: Turn) -> tuple[dict, str | None]:
        """A chat choice's message, and its finish reason ("tool_calls" where it ended on its own with calls)."""
        reader = self.reader(turn)
        deltas = reader.feed(turn.text, final=True)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        calls = [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                 for call_id, name, arguments in (reader.calls.call_list if reader.calls else [])]
        message = {"role": "assistant", "content": content or (None if calls else "")}
        if reader.split is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = calls
        return message, reader.finish_reason(turn.finish_reason)

    def echoed_prompt(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.codec.decode(prompt.ids)

    def choice_of(self, turn: Turn, chat: bool) -> dict:
        codec = self.codec
        choice = {"index": turn.index, "finish_reason": turn.finish_reason, "logprobs": None}
        if chat and turn.logprobs is not None:
            choice["logprobs"] = chat_logprobs(turn.logprobs, codec)
        elif turn.params.logprobs is not None and not chat:
            offsets = TextOffsets(codec)
            parts = [prompt_logprobs(turn.prompt.ids, turn.prompt_logprobs, codec, offsets,
                                     turn.prompt.text is not None)] if turn.params.echo else []
            if turn.logprobs is not None:
                parts.append(completion_logprobs(turn.logprobs, codec, offsets))
            choice["logprobs"] = joined(*parts) if parts else None
        if turn.params.return_token_ids or not self.codec.has_tokenizer:  # without a tokenizer, ids are the output
            choice["token_ids"] = turn.token_ids
        if turn.params.return_meta_info:
            choice["meta_info"] = meta_info(turn)
        if chat:
            choice["message"], choice["finish_reason"] = self.message_of(turn)
        else:
            choice["text"] = (self.echoed_prompt(turn.prompt) if turn.params.echo else "") + turn.text
        return choice

    async def collect(self, choices: ChoiceSet, early: list, chat: bool, response_id: str):
        """The whole answer once every choice has ended (499 if the client went away; a choice's failure is an
        HTTP error)."""
        try:
            async for _ in choices.events(early):
                pass
        except Failed as failed:
            await choices.abort_unfinished()
            choices.finish("error")
            raise ApiError(503 if failed.event.code == "verify_worker_down" else 500, failed.event.message,
                           kind="server_error", code=failed.event.code) from None
        except Disconnected:
            await choices.release()
            return Response(status_code=499)
        ordered = choices.ordered
        choices.finish("success")
        return {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": [self.choice_of(t, chat) for t in ordered],
            "usage": usage(ordered),
        }

    async def stream(self, choices: ChoiceSet, early: list, chat: bool, response_id: str):
        """SSE chunks as the choices' events arrive; a failure or a bug ends the stream with an error event and
        [DONE], never a reset connection; a client that goes away releases the choices."""
        codec, created = self.codec, int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        ordered = choices.ordered
        offsets = {turn.request_id: TextOffsets(codec) for turn in ordered}  # legacy text_offset, per choice
        params = choices.params

        readers = {turn.request_id: self.reader(turn) for turn in ordered if chat}
        readers = {rid: r for rid, r in readers.items() if r.reads}  # choices split into reasoning or calls

        def chunk(turn: Turn, delta: str | None, finish: str | None, role: bool = False, token_ids=None,
                  logprobs: dict | None = None, parts: dict | None = None) -> str:
            if chat:
                body = {} if delta is None else {"content": delta}
                body.update(parts or {})
                if role:
                    body["role"] = "assistant"
                choice = {"index": turn.index, "delta": body, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": turn.index, "text": delta or "", "finish_reason": finish, "logprobs": logprobs}
            if params.return_token_ids or not codec.has_tokenizer:
                choice["token_ids"] = token_ids or []
            if params.return_meta_info and finish is not None:
                choice["meta_info"] = meta_info(turn)
            payload = {"id": response_id, "object": kind, "created": created, "model": self.model_name,
                       "choices": [choice]}
            if params.include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        async def lines():
            wants_logprobs = params.logprobs is not None
            for turn in ordered:  # every choice was heard from: its prompt's log-probabilities are in
                if chat:
                    yield chunk(turn, "", None, role=True)
                elif params.echo:  # the prompt first, with its log-probabilities when asked for
                    yield chunk(turn, self.echoed_prompt(turn.prompt), None, logprobs=prompt_logprobs(
                        turn.prompt.ids, turn.prompt_logprobs, codec, offsets[turn.request_id],
                        turn.prompt.text is not None) if wants_logprobs else None)
            async for turn, delta, event, ended in choices.events(early):
                reader = readers.get(turn.request_id)
                if reader is not None:  # reasoning, content and calls; never a part of a tag in either
                    for parts in reader.feed(delta, final=ended):
                        yield chunk(turn, None, None, parts=parts)
                    if event.token_ids and (params.return_token_ids or wants_logprobs):
                        run = event_logprobs(event) if wants_logprobs else None
                        yield chunk(turn, None, None, token_ids=event.token_ids,
                                    logprobs=None if run is None else chat_logprobs(run, codec))
                elif delta or (event.token_ids and (params.return_token_ids or wants_logprobs
                                                    or not codec.has_tokenizer)):
                    run = event_logprobs(event) if wants_logprobs else None
                    logprobs = None if run is None else chat_logprobs(run, codec) if chat else \
                        completion_logprobs(run, codec, offsets[turn.request_id])
                    yield chunk(turn, delta, None, token_ids=event.token_ids, logprobs=logprobs)
                if ended:  # once per choice, after its last text
                    finish = turn.finish_reason if reader is None else reader.finish_reason(turn.finish_reason)
                    yield chunk(turn, None if chat else "", finish)
            if params.include_usage:
                body = {"id": response_id, "object": kind, "created": created, "model": self.model_name,
                        "choices": [], "usage": usage(ordered)}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        def error_lines(status: int, message: str, code: str) -> list[str]:
            error = ApiError(status, message, kind="server_error", code=code).body()
            return [f"data: {json.dumps(error)}\n\n", "data: [DONE]\n\n"]

        async for line in choices.guarded(lines(), error_lines, self.log, response_id):
            yield line


class ChatReader:
    """A chat choice's text, piece by piece, as the deltas of its message: reasoning_content (where answers are
    split: reasoning.py), content, and tool calls read from the content (where the request's tools are read:
    tool_call_stream.py; a call's start, then its arguments in pieces); a <tool_call> inside the reasoning stays
    reasoning."""

    def __init__(self, turn: Turn, call_format):
        params = turn.params
        self.split = ReasoningSplit(thinking=params.thinking) if params.thinking is not None else None
        reads_calls = params.tools is not None and params.tools.parses and call_format is not None
        self.calls = ToolCallStream(call_format, params.tools) if reads_calls else None

    @property
    def reads(self) -> bool:
        return self.split is not None or self.calls is not None

    def feed(self, text: str, final: bool) -> list[dict]:
        """The deltas of this piece (final: the choice ended, nothing is held back)."""
        reasoning, content = ("", text) if self.split is None else self.split.feed(text)
        if final and self.split is not None:
            rest = self.split.finish()
            reasoning, content = reasoning + rest[0], content + rest[1]
        out = [{"reasoning_content": reasoning}] if reasoning else []
        if self.calls is None:
            return out + ([{"content": content}] if content else [])
        for piece in self.calls.feed(content) + (self.calls.finish() if final else []):
            out.append({"content": piece.content} if piece.index is None else {"tool_calls": [piece.as_openai()]})
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" for a choice that ended on its own after calls."""
        return "tool_calls" if reason == "stop" and self.calls is not None and self.calls.calls else reason
