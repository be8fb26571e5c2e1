"""Reasoning parsers split <think>…</think> from the answer the same way however the text is cut."""

import random

import pytest

from frontend_gateway.parsers.reasoning import REASONING_PARSERS, ReasoningCounter, reasoning_parser


def parse(name: str, pieces: list[str]) -> tuple[str, str]:
    parser = reasoning_parser(name)
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.flush()
    return "".join([*reasoning, r]), "".join([*content, c])


def cuts(text: str) -> list[list[str]]:
    """The text whole, one character at a time, cut in two at every place, and cut at random."""
    rng = random.Random(len(text))
    ways = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(20):
        places = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randrange(1, 6))))
        ways.append([text[a:b] for a, b in zip([0, *places], [*places, len(text)], strict=True)])
    return ways


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("qwen3", "<think>Paris is the capital.</think>\n\nParis.", ("Paris is the capital.", "Paris.")),
        ("qwen3", "\n<think>a</think>b", ("a", "b")),
        ("qwen3", "No thinking here.", ("", "No thinking here.")),
        ("qwen3", "I <think> inside is text", ("", "I <think> inside is text")),
        ("qwen3", "<thin", ("", "<thin")),  # an unfinished tag at the end is text after all
        ("qwen3", "<think>cut off by max_tokens", ("cut off by max_tokens", "")),
        ("qwen3", "<think></think>", ("", "")),
        ("deepseek_r1", "Let me think.</think>The answer.", ("Let me think.", "The answer.")),
        ("deepseek_r1", "<think>Let me think.</think>\nThe answer.", ("Let me think.", "The answer.")),
        ("deepseek_r1", "never closed", ("never closed", "")),
        ("deepseek_r1", "a </thin b", ("a </thin b", "")),
        ("deepseek_r1", "x</think>y</think>z", ("x", "y</think>z")),  # only the first tag ends reasoning
    ],
)
def test_the_split_is_the_same_however_the_text_arrives(name: str, text: str, expected: tuple[str, str]) -> None:
    for pieces in cuts(text):
        assert parse(name, pieces) == expected, pieces


def test_reasoning_streams_before_the_closing_tag_arrives() -> None:
    parser = reasoning_parser("deepseek_r1")
    assert parser.feed("step one, ") == ("step one, ", "")
    assert parser.feed("step two</th") == ("step two", "")  # the tag's start is held back
    assert parser.feed("ink>\n\n") == ("", "")
    assert parser.feed("Done") == ("", "Done")


def test_the_parsers_have_vllms_names() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}


@pytest.mark.parametrize(
    ("name", "pieces", "tokens"),
    [
        ("qwen3", ["<think>", "Hm", ".</think>", "\n", "Hi"], 3),  # up to the piece that closes it
        ("qwen3", ["Just", " text"], 0),
        ("deepseek_r1", ["Hm", ".", "</think>", "Hi", "!"], 3),
        ("deepseek_r1", ["Still", " thinking"], 2),  # cut off while reasoning: all of it
    ],
)
def test_reasoning_tokens_are_those_up_to_the_end_of_the_reasoning(name: str, pieces: list[str], tokens: int) -> None:
    counter = ReasoningCounter(reasoning_parser(name))
    for count, piece in enumerate(pieces, start=1):  # a token per piece
        counter.feed(piece, count)
    assert counter.tokens == tokens
