"""StopMatcher: stop strings across piece boundaries, held-back text, flush."""

from __future__ import annotations

import random

import pytest

from meshlm.engine.stop import StopMatcher


def feed_all(matcher: StopMatcher, pieces: list[str]) -> list[str]:
    return [matcher.feed(p) for p in pieces]


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, min(6, len(text) - 1))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_no_stops_passes_everything_through_immediately():
    m = StopMatcher(())
    assert feed_all(m, ["Hel", "lo", " wo"]) == ["Hel", "lo", " wo"]
    assert m.flush() == "" and not m.stopped


def test_empty_stop_string_is_ignored():
    m = StopMatcher(("",))
    assert m.feed("abc") == "abc" and not m.stopped


def test_stop_split_across_pieces_is_not_leaked():
    m = StopMatcher(("STOP",))
    out = feed_all(m, ["Hello S", "T", "O", "P and more"])
    assert out == ["Hello ", "", "", ""]
    assert m.stopped
    # Once stopped nothing more comes out, not even via flush.
    assert m.feed("tail") == "" and m.flush() == ""


def test_stop_inside_one_piece_cuts_the_rest_of_the_piece():
    m = StopMatcher(("\n\n",))
    assert m.feed("line one\n\nline two") == "line one"
    assert m.stopped


def test_held_back_prefix_is_released_when_ruled_out():
    m = StopMatcher(("END",))
    assert m.feed("the E") == "the "  # "E" might start "END"
    assert m.feed("N") == ""  # "EN" still might
    assert m.feed("x") == "ENx"  # "ENx" cannot: all of it is released at once
    assert not m.stopped


def test_held_back_text_shrinks_to_the_longest_live_prefix():
    # "xaa" holds "aa" (may become "aaa"); after "b" only "ab" (may become "ab!") is live.
    m = StopMatcher(("aaa", "ab!"))
    assert m.feed("xaa") == "x"
    assert m.feed("b") == "a"  # "aab": "ab" may still become "ab!"
    assert m.feed("?") == "ab?"


def test_self_overlapping_stop_is_found_after_a_false_start():
    m = StopMatcher(("aab",))
    assert feed_all(m, ["a", "a", "a", "b", "c"]) == ["", "", "a", "", ""]
    assert m.stopped


def test_multiple_stops_earliest_occurrence_wins():
    m = StopMatcher(("world", "lo"))
    assert m.feed("hello world") == "hel"
    m = StopMatcher(("lo", "world"))  # order of the tuple does not matter
    assert "".join(feed_all(m, ["hel", "l", "o world"])) == "hel"


def test_flush_releases_held_back_prefix_when_sequence_ends_otherwise():
    m = StopMatcher(("STOP",))
    assert m.feed("almost ST") == "almost "
    assert m.flush() == "ST"
    assert m.flush() == ""  # nothing twice


@pytest.mark.parametrize("seed", range(10))
def test_random_splits_never_leak_and_lose_nothing(seed):
    rng = random.Random(seed)
    stops = ("</s>", "###", "Observation:")
    body = "".join(rng.choice(["a", "b", "<", "/", "s", "#", " ", "Obs", "ervation", ":"]) for _ in range(40))
    for stop_at in (None, *stops):
        text = body + (stop_at or "") + "trailing text"
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
        expected = text if cut is None else text[:cut]
        m = StopMatcher(stops)
        shown = ""
        for piece in random_split(text, rng):
            shown += m.feed(piece)
            # At no point is anything beyond the first stop position shown.
            assert expected.startswith(shown)
        shown += m.flush()
        assert shown == expected
        assert m.stopped is (cut is not None)


@pytest.mark.parametrize("stop, text, shown", [
    ("aab", "aaab", "a"),  # a partial match that fails must fall back, not restart past the overlap
    ("abab", "ababab", ""),
    ("abcabd", "abcabcabd!", "abc"),
    ("xx", "axxb", "a"),
])
def test_overlapping_prefixes_fall_back_correctly(stop, text, shown):
    rng = random.Random(len(text))
    for _ in range(20):
        m = StopMatcher((stop,))
        assert "".join(feed_all(m, random_split(text, rng))) == shown and m.stopped


def test_first_stop_to_complete_wins_and_ties_cut_at_the_earliest_start():
    m = StopMatcher(("bc", "abcd"))
    assert m.feed("xabcd") == "xa" and m.stopped  # "bc" completes first
    m = StopMatcher(("cd", "bcd"))
    assert m.feed("abcde") == "a"  # both complete at "d": the longer started earlier


def test_matching_cost_does_not_grow_with_the_stop_strings_length():
    """O(new text) per piece: 1,000-character stop strings cost about what 2-character ones do."""
    import time

    def cost(stops):
        m = StopMatcher(stops)
        t0 = time.perf_counter()
        for i in range(3000):
            m.feed("ab c" if i % 2 else "de f")
        return time.perf_counter() - t0

    short = min(cost(tuple(c * 2 for c in "wxyz")) for _ in range(3))
    long = min(cost(tuple(c * 999 + "!" for c in "wxyz")) for _ in range(3))
    assert long < 3 * short, (short, long)


@pytest.mark.parametrize("seed", range(5))
def test_include_shows_the_stop_string_and_nothing_after_it(seed):
    """vLLM's include_stop_str_in_output: the text ends with the stop string that completed first."""
    rng = random.Random(seed)
    stops = ("</s>", "ab#")
    text = "".join(rng.choice(["a", "b", "<", "/", "s", "#", ">", " "]) for _ in range(30)) + "</s> after"
    end = min(i + len(s) for s in stops if (i := text.find(s)) >= 0)
    m = StopMatcher(stops, include=True)
    shown = "".join(m.feed(piece) for piece in random_split(text, rng)) + m.flush()
    assert shown == text[:end] and m.stopped


def test_a_match_that_is_no_stop_is_shown_and_the_next_one_stops():
    """Within min_tokens a stop string is no stop (vLLM checks them only past min_tokens): its text is
    shown, and a later occurrence, overlapping it or not, stops."""
    m = StopMatcher(("abab",))
    assert m.feed("xabab", armed=False) == "xab" and not m.stopped  # "ab" may start the next "abab"
    assert m.feed("ab") == "" and m.stopped  # "ab" + "ab": the border grew into a whole match
    m = StopMatcher(("END",))
    assert m.feed("1 END", armed=False) + m.feed(" 2 EN") == "1 END 2 " and m.feed("D tail") == "" and m.stopped
