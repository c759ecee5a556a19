"""StopMatcher's contract: text is released as soon as it cannot start a stop string,
a stop (even split across pieces) ends the stream and is never shown, and the held
tail comes back on flush."""

from __future__ import annotations

import pytest

from clawd.stops import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    """Feed pieces until a hit; return (emitted per piece, hit, flushed tail)."""
    m = StopMatcher(stops)
    out: list[str] = []
    hit = False
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            break
    return out, hit, ("" if hit else m.flush())


CASES = [
    # id, stops, pieces, emitted per piece, hit, flushed tail
    ("inside-one-piece", ["STOP"], ["abSTOPcd"], ["ab"], True, ""),
    ("at-start", ["STOP"], ["STOP and more"], [""], True, ""),
    ("split-across-pieces", ["\nUser:"], ["Hi", " there\nU", "ser:", " next"], ["Hi", " there", ""], True, ""),
    ("split-over-three", ["END"], ["x", "E", "N", "D", "y"], ["x", "", "", ""], True, ""),
    ("partial-then-mismatch", ["\nUser:"], ["Hello\nUs", "e it"], ["Hello", "\nUse it"], False, ""),
    ("partial-then-mismatch-then-stop", ["STOP"], ["aST", "x", "bSTOP"], ["a", "STx", "b"], True, ""),
    ("held-prefix-restarts", ["abc"], ["aa", "bc"], ["a", ""], True, ""),
    ("earliest-of-many", ["two", "one"], ["zero one two"], ["zero "], True, ""),
    ("earliest-of-many-split", ["\nUser:", "\nTool result:"], ["ok\nTool", " result: x\nUser:"], ["ok", ""], True, ""),
    ("flush-returns-held", ["\nUser:"], ["done\nUs"], ["done"], False, "\nUs"),
    ("flush-nothing-held", ["STOP"], ["plain"], ["plain"], False, ""),
    ("no-stops-passthrough", [], ["a\nUser:", "b"], ["a\nUser:", "b"], False, ""),
    ("empty-stop-ignored", [""], ["abc"], ["abc"], False, ""),
    ("unicode", ["。"], ["日本", "語。後"], ["日本", "語"], True, ""),
]


@pytest.mark.parametrize("stops,pieces,emitted,hit,tail", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_stop_matcher(stops, pieces, emitted, hit, tail):
    got, got_hit, got_tail = run(stops, pieces)
    assert got == emitted
    assert got_hit is hit
    assert got_tail == tail


@pytest.mark.parametrize(
    "stops,pieces",
    [
        (["\nUser:"], ["Hello\nUs", "e it", " and ", "\n", "bye"]),
        (["ab", "abc"], ["xa", "bb", "a"]),
        (["STOP"], ["S", "T", "O", "P"]),
    ],
)
def test_no_text_lost_or_duplicated(stops, pieces):
    """Everything emitted + flushed equals the input up to the first stop."""
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            break
    else:
        out.append(m.flush())
    whole = "".join(pieces)
    cut = min((i for i in (whole.find(s) for s in stops) if i >= 0), default=len(whole))
    assert "".join(out) == whole[:cut]


def test_flush_empties_matcher():
    m = StopMatcher(["\nUser:"])
    assert m.feed("a\n") == ("a", False)
    assert m.flush() == "\n"
    assert m.flush() == ""
