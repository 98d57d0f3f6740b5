"""Stop strings (kipp.text.stops): the same cut and the same hold-back as a naive per-character
rule, and per-token work that does not grow with the stop strings' length."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kipp.model import GenerationError
from kipp.text.stops import StopError, StopPatterns, StopStrings


def naive(stops, pieces):
    """The oracle: after every character, cut at a stop string that ends there (the longest if
    several do); otherwise the text may be emitted except its longest suffix that is a proper
    prefix of some stop string. Returns the emitted text after each piece, whether and where it
    stopped, and the stop string that ended it."""
    text, emitted, outputs = "", 0, []
    for piece in pieces:
        for c in piece:
            text += c
            ending = [s for s in stops if text.endswith(s)]
            if ending:
                cut = len(text) - max(len(s) for s in ending)
                outputs.append(text[emitted:cut])
                return outputs, True, text[:cut], max(ending, key=len)
        hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
                   default=0)
        outputs.append(text[emitted: len(text) - hold])
        emitted = len(text) - hold
    return outputs, False, text, None


alphabet = st.sampled_from("abc\u00e9")


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text(alphabet, min_size=1, max_size=6), min_size=1, max_size=4),
       pieces=st.lists(st.text(alphabet, max_size=5), max_size=12))
def test_matches_the_naive_rule(stops, pieces):
    expected, stopped, full, which = naive(stops, pieces)
    s = StopStrings(StopPatterns(stops))
    got = []
    for piece in pieces:
        text, hit = s.feed(piece)
        got.append(text)
        if hit:
            break
    assert got == expected
    assert hit if pieces and stopped else not s.stopped
    assert s.hit == which  # the stop string Finished.stop reports
    if not stopped:
        assert "".join(got) + s.flush() == full


def test_examples():
    s = StopStrings(["</s>", "\n\n"])
    assert s.feed("Hello <") == ("Hello ", False)
    assert s.pending == "<"
    assert s.feed("/") == ("", False)
    assert s.feed("b>") == ("</b>", False)
    assert s.feed("x\n") == ("x", False)
    assert s.feed("\nmore") == ("", True) and s.stopped
    # Two stop strings ending at the same character: the longer one cuts.
    s = StopStrings(["bc", "abc"])
    assert s.feed("xxabcd") == ("xx", True)
    # The earliest end wins, however the text was split.
    for pieces in (["abcd"], ["a", "b", "c", "d"], ["ab", "cd"]):
        s = StopStrings(["abcd", "bc"])
        out = ""
        for p in pieces:
            text, hit = s.feed(p)
            out += text
            if hit:
                break
        assert (out, hit) == ("a", True)
    s = StopStrings(["xyz"])
    assert s.feed("ab xy") == ("ab ", False) and s.flush() == "xy"
    assert StopStrings([]).feed("anything") == ("anything", False)


def test_bad_stop_strings(models):
    with pytest.raises(StopError, match="non-empty"):
        StopPatterns(["ok", ""])
    model = models("kipp-synthetic/qwen3-tiny")
    with pytest.raises(GenerationError, match="non-empty"):
        model.generate("Hi", 4, stop=[3])
    assert model.pool.num_in_use == 0 and model.engine.idle


@pytest.mark.parametrize("stop", ["x" * 20_000, "ab" * 10_000 + "c"])
def test_per_token_work_does_not_grow_with_the_stop_length(stop):
    """A long stop string costs its compile once, then per token about what a short one does.
    The old hold-back check cost the square of the stop length per token (seconds here)."""
    patterns = StopPatterns([stop])
    tokens = ["ab", "ab", "xx", "x", " ", "abab", "xxxx", "y"] * 40

    def run(p):
        s = StopStrings(p)
        start = time.perf_counter()
        for t in tokens:
            s.feed(t)
        return time.perf_counter() - start

    short = min(run(StopPatterns(["x" * 20])) for _ in range(3))
    long = min(run(patterns) for _ in range(3))
    print(f"\n{len(tokens)} tokens: short stop {short * 1e3:.2f} ms, {len(stop)}-char stop "
          f"{long * 1e3:.2f} ms")
    assert long < 0.25  # 320 tokens; the quadratic check took > 60 s for these here
    assert long < 20 * short + 0.05


def test_held_text_is_released_without_copying_it_whole():
    """A stop string that matches a long stretch holds it back; each token still costs little,
    and the held text comes out intact when the match breaks."""
    stop = "a" * 50_000 + "b"
    s = StopStrings([stop])
    start = time.perf_counter()
    for _ in range(10_000):
        assert s.feed("aaaa") == ("", False)
    per_token = (time.perf_counter() - start) / 10_000
    assert per_token < 1e-3
    text, hit = s.feed("c")
    assert not hit and text == "a" * 40_000 + "c"
