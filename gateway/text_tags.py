"""Tags in streamed text."""


def partial_tag_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a beginning of tag (held back: the tag may be arriving)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
