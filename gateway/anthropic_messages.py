"""Anthropic's Messages API in terms of the chat path: a request body as a chat completion body, a chat answer as a
message, a chat stream's deltas as Anthropic's event sequence, errors in Anthropic's shape. Lenient about what it
does not use (metadata, cache_control, signatures, service tiers): those are ignored, never refused. Pure."""

import json
import uuid

from gateway.schemas import ApiError

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 499: "api_error",
               500: "api_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _text_of(content, where: str) -> str:
    """A string, or the text of a list of text blocks (other blocks refused, naming them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content blocks", param="messages")
    texts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise ApiError(400, f"{where}: only text blocks are supported here, not {kind!r}", param="messages")
        texts.append(block["text"])
    return "".join(texts)


def _user_turn(content, i: int) -> list[dict]:
    """A user turn as chat messages: its tool results first (one tool message each), then its text."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of content blocks", param="messages")
    results, texts = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_result":
            inner = block.get("content", "")
            text = _text_of(inner, f"messages[{i}].content[{j}].content") if inner else ""
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text})
        elif kind in ("image", "document"):
            raise ApiError(400, f"messages[{i}].content[{j}]: {kind} blocks are not supported by this server (text "
                           "only)", param="messages")
        else:
            raise ApiError(400, f"messages[{i}].content[{j}]: a user turn holds text and tool_result blocks, not "
                           f"{kind!r}", param="messages")
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _assistant_turn(content, i: int) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of content blocks", param="messages")
    message = {"role": "assistant", "content": ""}
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            message["content"] += str(block.get("text", ""))
        elif kind == "thinking":  # its signature is not checked: this server signs nothing
            message["reasoning_content"] = message.get("reasoning_content", "") + str(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise ApiError(400, f"messages[{i}].content[{j}]: a tool_use block needs a name and an object input",
                               param="messages")
            message.setdefault("tool_calls", []).append({
                "id": str(block.get("id", "")), "type": "function",
                "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        else:
            raise ApiError(400, f"messages[{i}].content[{j}]: an assistant turn holds text, thinking and tool_use "
                           f"blocks, not {kind!r}", param="messages")
    return message


def chat_body(body: dict, count_only: bool = False) -> dict:
    """The chat completion body of a Messages request (max_tokens is required unless only counting)."""
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    max_tokens = body.get("max_tokens", 1 if count_only else None)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(400, "'max_tokens' is required: a positive integer", param="max_tokens")
    messages = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    for i, message in enumerate(body["messages"]):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            messages += _user_turn(message.get("content", ""), i)
        elif role == "assistant":
            messages.append(_assistant_turn(message.get("content", ""), i))
        else:
            raise ApiError(400, f"messages[{i}].role must be \"user\" or \"assistant\" (the system prompt is the "
                           "'system' field)", param="messages")
    chat = {"messages": messages, "max_tokens": max_tokens, "stream": bool(body.get("stream", False))}
    for name in ("model", "temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    chat.update(_tools(body))
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
        if thinking["type"] == "enabled" and isinstance(thinking.get("budget_tokens"), int):
            chat["thinking_token_budget"] = thinking["budget_tokens"]
    return chat


def _tools(body: dict) -> dict:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", param="tools")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            raise ApiError(400, f"tools[{i}]: only client tools (name, input_schema) are supported, not the server "
                           f"tool {tool.get('type') if isinstance(tool, dict) else tool!r}", param="tools")
        functions.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description", ""),
            "parameters": tool.get("input_schema", {"type": "object"})}})
    if not functions:
        return {}
    out: dict = {"tools": functions}
    choice = body.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise ApiError(400, "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
                       param="tool_choice")
    out["tool_choice"] = ({"type": "function", "function": {"name": choice.get("name")}} if kind == "tool" else
                          {"auto": "auto", "any": "required", "none": "none"}[kind])
    out["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
    return out


def message_of(message_id: str, model: str, answer: dict, stop_sequence: str | None = None) -> dict:
    """A chat completion (one choice) as an Anthropic message; stop_sequence: the stop string that ended it."""
    choice, usage = answer["choices"][0], answer["usage"]
    chat = choice["message"]
    content = []
    if chat.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": chat["reasoning_content"], "signature": ""})
    if chat.get("content"):
        content.append({"type": "text", "text": chat["content"]})
    for call in chat.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": "stop_sequence" if stop_sequence else STOP_REASONS.get(choice["finish_reason"], "end_turn"),
            "stop_sequence": stop_sequence,
            "usage": anthropic_usage(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                                     usage["completion_tokens"])}


def anthropic_usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """Anthropic's usage: input_tokens counts the prompt tokens not read from the cache."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_read_input_tokens": cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": output_tokens}


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


class MessageEvents:
    """A chat choice's deltas (responses.ChatReader's: reasoning_content, content, tool calls in pieces) as Anthropic's
    event sequence: message_start, then per content block its start, deltas and stop, then message_delta and
    message_stop."""

    def __init__(self, model: str, input_tokens: int, cached_tokens: int = 0):
        self.id = "msg_" + uuid.uuid4().hex
        self.model, self.input_tokens, self.cached_tokens = model, input_tokens, cached_tokens
        self.index, self.open = -1, None  # the current block's index and kind

    def start(self) -> str:
        return event("message_start", {"message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": anthropic_usage(self.input_tokens, self.cached_tokens, 0)}})

    def _block(self, kind: str, block: dict) -> list[str]:
        out = self._close()
        self.index, self.open = self.index + 1, kind
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "signature_delta", "signature": ""}}))
        self.open = None
        return out + [event("content_block_stop", {"index": self.index})]

    def delta(self, parts: dict) -> list[str]:
        out = []
        if parts.get("reasoning_content"):
            if self.open != "thinking":
                out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(event("content_block_delta", {"index": self.index, "delta": {
                "type": "thinking_delta", "thinking": parts["reasoning_content"]}}))
        if parts.get("content"):
            if self.open != "text":
                out += self._block("text", {"type": "text", "text": ""})
            out.append(event("content_block_delta", {"index": self.index, "delta": {
                "type": "text_delta", "text": parts["content"]}}))
        for call in parts.get("tool_calls") or []:  # a call's start (its id), then its arguments in pieces
            if "id" in call:
                out += self._block("tool_use", {"type": "tool_use", "id": call["id"],
                                                "name": call["function"]["name"], "input": {}})
            if call["function"].get("arguments"):
                out.append(event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": call["function"]["arguments"]}}))
        return out

    def stop(self, finish_reason: str | None, output_tokens: int, stop_sequence: str | None = None) -> list[str]:
        reason = "stop_sequence" if stop_sequence else STOP_REASONS.get(finish_reason, "end_turn")
        return self._close() + [
            event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                                    "usage": {"output_tokens": output_tokens}}),
            event("message_stop", {})]
