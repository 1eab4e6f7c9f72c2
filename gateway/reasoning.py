"""A thinking model's answer split into reasoning_content and content: the text between <think> and </think>
(GLM-4.5 to 5.x, Qwen3 and their kin), whether the model writes the opening tag or the chat template already wrote
it at the end of the prompt (GLM-5.3 always thinks: its template opens the section whatever enable_thinking says),
fed in pieces of any size; a piece that may begin a tag is held back, so no part of a tag reaches either field. An
answer that ends inside an open section is all reasoning. Pure text."""

from dataclasses import dataclass

from gateway.text_tags import partial_tag_suffix

OPEN, CLOSE = "<think>", "</think>"


def reasoning_parser_on(parser: str, chat_template: str) -> bool:
    """Whether answers are split (--reasoning-parser; auto: where the chat template writes <think>)."""
    return parser == "think" or (parser == "auto" and OPEN in chat_template)


def opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a thinking section open (its last <think> after its last </think>)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


@dataclass
class ReasoningSplit:
    """Pieces of an answer -> (reasoning, content) pieces. `thinking`: the prompt left a section open."""

    thinking: bool = False
    closed: bool = False  # just past </think>: its newlines are dropped
    done: bool = False  # the section closed: the rest is content
    buffer: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        while self.buffer:
            if self.done:
                if self.closed:  # the newlines after </think> separate the section: not content
                    self.buffer = self.buffer.lstrip("\n")
                    self.closed = not self.buffer
                content, self.buffer = content + self.buffer, ""
                break
            if not self.thinking:
                stripped = self.buffer.lstrip()
                if not stripped:
                    break  # only whitespace so far: an opening tag may follow
                if stripped.startswith(OPEN):
                    self.buffer, self.thinking = stripped[len(OPEN):], True
                    continue
                if OPEN.startswith(stripped):
                    break  # the tag may be arriving
                self.done = True  # no section: all of it is content
                continue
            at = self.buffer.find(CLOSE)
            if at >= 0:
                reasoning += self.buffer[:at]
                self.buffer, self.done, self.closed = self.buffer[at + len(CLOSE):], True, True
                continue
            keep = partial_tag_suffix(self.buffer, CLOSE)
            reasoning += self.buffer[:len(self.buffer) - keep]
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back at the end: reasoning inside an open section, else content."""
        text, self.buffer = self.buffer, ""
        return (text, "") if self.thinking and not self.done else ("", text)


def split_whole(text: str, thinking: bool) -> tuple[str, str]:
    """A whole answer: (reasoning, content)."""
    split = ReasoningSplit(thinking=thinking)
    parts = [split.feed(text), split.finish()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)
