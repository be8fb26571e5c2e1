"""Stop strings are found across piece boundaries and never shown."""

from engines.echo import EchoFullEngine
from frontend_gateway.models.pipeline import TextModel
from frontend_gateway.openai_api.stop_strings import StopStringMatcher
from frontend_gateway.openai_api.types import CompletionRequest


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


def test_no_stop_string_ends_in_text_fed_before_min_tokens() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("abENDc", may_stop=False) == ("abENDc", False)
    assert matcher.feed("dENDe") == ("d", True)


def test_a_stop_string_begun_before_min_tokens_and_completed_after_it_stops() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("abEN", may_stop=False) == ("ab", False)
    assert matcher.feed("Dx") == ("", True)


def test_a_short_stop_string_inside_held_text_from_before_min_tokens_does_not_stop() -> None:
    matcher = StopStringMatcher(["ab", "xabc"])
    assert matcher.feed("xab", may_stop=False) == ("", False)
    assert matcher.feed("d") == ("xabd", False)


async def test_a_text_engine_s_stop_string_waits_for_min_tokens_too() -> None:
    model = TextModel("echo", EchoFullEngine(0.0))
    request = CompletionRequest(model="echo", prompt="abcabcd", stop=["b"], min_tokens=3)
    generation = await model.prepare_completion(request)
    assert "".join([piece async for piece in generation.pieces()]) == "abca"
    assert (generation.completion_tokens, generation.finish_reason) == (5, "stop")
