"""Incremental detokenization never splits UTF-8; stop strings are never partly emitted; chat templates."""

import json

from gateway.tokenization import IncrementalDetokenizer, StopMatcher, TextCodec
from shared.byte_tokenizer import build_byte_tokenizer, write_byte_tokenizer


def test_deltas_never_split_a_character():
    tokenizer = build_byte_tokenizer()
    text = "naïve café — 数据 🚀 ok"
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    assert deltas[ids.index(0xF0)] == ""  # the first byte of the rocket waits for the other three


def test_invalid_bytes_are_flushed_at_the_end():
    detok = IncrementalDetokenizer(build_byte_tokenizer())
    assert detok.add([104]) == "h"
    assert detok.add([0xE2]) == "" and detok.add([0x82]) == ""  # an incomplete character is held back
    assert detok.flush() == "\ufffd"  # and shown as U+FFFD only when the stream ends without completing it


def test_stop_strings_are_held_back_until_decided():
    matcher = StopMatcher(["</end>", "\n\n"])
    emitted = []
    for delta in ["abc<", "/en", "x and \n", "more", "<", "/end> tail"]:
        text, stopped = matcher.feed(delta)
        emitted.append(text)
        if stopped:
            break
    assert "".join(emitted) == "abc</enx and \nmore" and stopped
    assert all("</end>" not in e for e in emitted)


def test_chat_template_from_tokenizer_config(tmp_path):
    write_byte_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|endoftext|>"},
        "chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}"}))
    codec = TextCodec.from_folder(tmp_path, config_eos=(5,))
    assert codec.eos_token_ids == (5, 256)
    assert codec.render_chat([{"role": "user", "content": "hi"}], 1000) == "[user] hi\n[assistant] "


def test_fallback_chat_template(tmp_path):
    write_byte_tokenizer(tmp_path)
    codec = TextCodec.from_folder(tmp_path)
    assert codec.render_chat([{"role": "user", "content": "hi"}], 1000) == "user: hi\nassistant: "


def test_logprob_tokens_keep_their_bytes_and_offsets_follow_the_text(tmp_path):
    from gateway.logprobs import TextOffsets, TokenLogprobs, chat_logprobs, completion_logprobs

    write_byte_tokenizer(tmp_path)
    codec = TextCodec.from_folder(tmp_path)
    text = "a é🚀b"
    ids = codec.encode(text) + [codec.tokenizer.token_to_id("<|endoftext|>")]
    run = TokenLogprobs(ids, [-0.5] * len(ids), [[ids[0]]] * len(ids), [[-0.1]] * len(ids))
    offsets = TextOffsets(codec)
    first = completion_logprobs(TokenLogprobs(ids[:3], run.logprobs[:3], run.top_ids[:3], run.top_logprobs[:3]),
                                codec, offsets)
    rest = completion_logprobs(TokenLogprobs(ids[3:], run.logprobs[3:], run.top_ids[3:], run.top_logprobs[3:]),
                               codec, offsets)  # a second stream chunk carries on
    tokens = first["tokens"] + rest["tokens"]
    assert tokens[:4] == ["a", " ", "bytes:\\xc3", "bytes:\\xa9"] and tokens[-2:] == ["b", "<|endoftext|>"]
    # é starts at 2 (both its bytes), the rocket at 3 (all four), b at 4; the special token adds no text
    assert first["text_offset"] + rest["text_offset"] == [0, 1, 2, 2, 3, 3, 3, 3, 4, 5]
    assert first["top_logprobs"][2] == {"a": -0.1, "bytes:\\xc3": -0.5}  # the chosen token is always listed
    content = chat_logprobs(run, codec)["content"]
    assert b"".join(bytes(t["bytes"]) for t in content[:-1]).decode() == text
    assert content[2]["token"] == "\ufffd" and content[0]["top_logprobs"] == [{"token": "a", "logprob": -0.1,
                                                                               "bytes": [97]}]


def test_token_bytes_of_sentencepiece_pieces_and_offsets_of_added_tokens(tmp_path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from gateway.logprobs import TextOffsets

    pieces = Tokenizer(models.BPE(vocab={"\u2581world": 0, "<0x0A>": 1, "a": 2, "b": 3}, merges=[]))
    pieces.pre_tokenizer = pre_tokenizers.Metaspace()
    pieces.decoder = decoders.Metaspace()
    pieces.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec.from_folder(tmp_path)
    assert codec.token_bytes(0) == b" world" and codec.token_bytes(1) == b"\n" and codec.token_bytes(2) == b"a"
    tokenizer = build_byte_tokenizer()
    tokenizer.add_tokens([AddedToken("<think>", special=False)])  # shown in the text, unlike <|endoftext|>
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec.from_folder(tmp_path)
    think, end = codec.tokenizer.token_to_id("<think>"), codec.tokenizer.token_to_id("<|endoftext|>")
    assert not codec.is_special(think) and codec.is_special(end)
    assert TextOffsets(codec).take([97, think, 98, end, 99]) == [0, 1, 8, 9, 9]
    assert TextOffsets(codec).take([97, end, 98], keep_special=True) == [0, 1, 14]  # a prompt as the client wrote it
