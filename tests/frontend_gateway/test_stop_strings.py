"""Stop strings are found across piece boundaries and never shown."""

from frontend_gateway.stop_strings import StopStringMatcher


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, bool]:
    shown = []
    for piece in pieces:
        text, hit = matcher.feed(piece)
        shown.append(text)
        if hit:
            return "".join(shown), True
    shown.append(matcher.flush())
    return "".join(shown), False


def test_a_stop_string_inside_one_piece_cuts_before_it() -> None:
    assert feed_all(StopStringMatcher(["END"]), ["abcENDdef"]) == ("abc", True)


def test_a_stop_string_split_over_pieces_is_found() -> None:
    assert feed_all(StopStringMatcher(["END"]), ["ab", "cE", "N", "Dxyz"]) == ("abc", True)


def test_a_partial_match_that_fails_is_released_unchanged() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("abEN") == ("ab", False)
    assert matcher.feed("x") == ("ENx", False)


def test_text_held_at_the_end_is_flushed_when_no_stop_came() -> None:
    assert feed_all(StopStringMatcher(["END"]), ["abcE"]) == ("abcE", False)


def test_the_earliest_of_several_stop_strings_wins() -> None:
    assert feed_all(StopStringMatcher(["world", "lo w"]), ["hello world"]) == ("hel", True)


def test_a_stop_string_that_is_a_prefix_of_another_still_stops() -> None:
    assert feed_all(StopStringMatcher(["ab", "abc"]), ["xa", "bc"]) == ("x", True)
