"""Stop strings over streamed text (pure), and the output processor over real SmolLM2 tokens."""

from __future__ import annotations

import pytest

from gateway.model import ServedModel
from gateway.output import OutputChunk, OutputProcessor
from gateway.stop_strings import StopStringMatcher
from tandem.v1 import common_pb2


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], str | None]:
    emitted: list[str] = []
    for piece in pieces:
        text, stop = matcher.feed(piece)
        emitted.append(text)
        if stop is not None:
            return emitted, stop
    emitted.append(matcher.flush())
    return emitted, None


def test_no_stop_strings_pass_text_through() -> None:
    m = StopStringMatcher(["END"])
    assert feed_all(m, ["Hello", " wor", "ld"]) == (["Hello", " wor", "ld", ""], None)


def test_stop_split_across_pieces_is_held_back_then_truncated() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc S") == ("abc ", None)
    assert m.held_text == "S"
    assert m.feed("T") == ("", None)
    assert m.feed("OP and more") == ("", "STOP")
    assert m.matched == "STOP"


def test_held_text_is_released_when_it_stops_matching() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST") == ("", None)
    assert m.feed("ay") == ("STay", None)
    assert m.feed("S") == ("", None)
    assert m.flush() == "S"  # the generation ended: the tail was never a stop string


def test_include_stop_string_keeps_the_match() -> None:
    m = StopStringMatcher(["</s>"], include_stop_string=True)
    assert feed_all(m, ["x </", "s> tail"]) == (["x ", "</s>"], "</s>")


def test_the_stop_that_ends_first_wins() -> None:
    # "bc" is complete after "abc"; "abcd" would need one more character.
    assert StopStringMatcher(["abcd", "bc"]).feed("abcd") == ("a", "bc")
    # Both end at the same character: the one that starts first (the longer) wins.
    assert StopStringMatcher(["bc", "abc"]).feed("xabc") == ("x", "abc")


def test_overlapping_candidates_hold_the_longest_possible_prefix() -> None:
    m = StopStringMatcher(["aab", "ab"])
    assert m.feed("xa") == ("x", None)  # "a" could begin either
    assert m.feed("a") == ("", None)  # "aa" could begin "aab"
    assert m.feed("b!") == ("", "aab")  # "aab" and "ab" both end here; "aab" starts first


def test_repeated_first_character_finds_the_later_start() -> None:
    m = StopStringMatcher(["aab"])
    assert m.feed("aaa") == ("a", None)  # only the last "aa" can still begin "aab"
    assert m.feed("b") == ("", "aab")


def test_unicode_stop_strings_split_by_code_point() -> None:
    m = StopStringMatcher(["日本語", "🚀!"])
    emitted, stop = feed_all(m, ["テキスト日", "本", "語です"])
    assert "".join(emitted) == "テキスト" and stop == "日本語"
    emitted, stop = feed_all(StopStringMatcher(["🚀!"]), ["go 🚀", "🚀", "!"])
    assert "".join(emitted) == "go 🚀" and stop == "🚀!"


@pytest.mark.real_model
def test_processor_stops_inside_a_token_and_counts_tokens_up_to_the_match(served_model: ServedModel) -> None:
    tok = served_model.tokenizer
    ids = tok.encode(" The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    out = OutputProcessor(tok, tok.encode("Say:"), stop=["own f"])
    chunk = OutputChunk()
    for i in ids:  # one token per delta, as a decode node sends them
        out.add(chunk, [i])
        if out.finished:
            break
    assert chunk.text == " The quick br"
    assert chunk.finish_reason == common_pb2.FINISH_REASON_STOP and chunk.stop_string == "own f"
    # The stop completes with " fox": tokens " The", " quick", " brown", " fox".
    assert out.num_tokens == 4 and chunk.token_ids == ids[:4]


@pytest.mark.real_model
def test_processor_flushes_held_text_at_the_engine_finish(served_model: ServedModel) -> None:
    tok = served_model.tokenizer
    ids = tok.encode("Ünïcödé 日本語 🚀 end", add_special_tokens=False)
    out = OutputProcessor(tok, [], stop=["end!"])
    chunks = []
    for n, i in enumerate(ids):
        chunk = OutputChunk()
        out.add(chunk, [i], finish_reason=common_pb2.FINISH_REASON_LENGTH if n == len(ids) - 1 else None)
        chunks.append(chunk)
    assert "".join(c.text for c in chunks) == "Ünïcödé 日本語 🚀 end"
    assert all("\ufffd" not in c.text for c in chunks)
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and chunks[-1].stop_string == ""
