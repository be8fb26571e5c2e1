"""Log probabilities keep their tokens' order and places: across a network frame's merged outputs, and
in completions' text offsets over several stream chunks."""

from frontend_gateway.models.remote_engines import merge_engine_outputs
from frontend_gateway.openai_api.logprobs import CompletionLogprobs, LogprobEntry, chat_logprobs
from runtime.protocol import EngineOutput, TokenLogprob


def test_outputs_merged_from_one_frame_keep_every_tokens_logprob() -> None:
    first, second = TokenLogprob(-0.5, [(1, -0.5), (9, -1.0)]), TokenLogprob(-0.1, [(2, -0.1), (8, -3.0)])
    outputs = [EngineOutput([1], logprobs=[first]), EngineOutput([2], logprobs=[second]), EngineOutput([], "stop")]
    assert merge_engine_outputs(outputs) == EngineOutput([1, 2], "stop", logprobs=[first, second])


def test_outputs_without_logprobs_merge_without_them() -> None:
    assert merge_engine_outputs([EngineOutput([1]), EngineOutput([2], "length")]).logprobs is None


def test_completion_offsets_run_on_across_chunks() -> None:
    shaper = CompletionLogprobs()
    one = shaper.shape([LogprobEntry(" Paris", -0.2, [(" Paris", -0.2)]), LogprobEntry(".", -0.3, [])])
    two = shaper.shape([LogprobEntry("\n", -1.0, [])])
    assert one["text_offset"] == [0, 6] and two["text_offset"] == [7]
    assert one["top_logprobs"] == [{" Paris": -0.2}, {}]


def test_chat_entries_carry_the_tokens_bytes() -> None:
    shaped = chat_logprobs([LogprobEntry("é", -0.5, [("é", -0.5), ("e", -2.0)])])
    assert shaped["content"][0] == {
        "token": "é",
        "logprob": -0.5,
        "bytes": [195, 169],
        "top_logprobs": [
            {"token": "é", "logprob": -0.5, "bytes": [195, 169]},
            {"token": "e", "logprob": -2.0, "bytes": [101]},
        ],
    }


def test_the_prompts_logprobs_survive_a_frames_merge() -> None:
    prompt = [TokenLogprob(-2.0, [(5, -1.0)]), TokenLogprob(-0.5, [(6, -0.5)])]
    outputs = [EngineOutput([1], prompt_logprobs=prompt), EngineOutput([2], "length")]
    assert merge_engine_outputs(outputs) == EngineOutput([1, 2], "length", prompt_logprobs=prompt)


def test_an_echoed_prompts_first_token_has_null_numbers() -> None:
    shaped = CompletionLogprobs().shape([LogprobEntry("The", None, None), LogprobEntry(" cat", -3.5, [(" dog", -1.0)])])
    assert shaped == {
        "tokens": ["The", " cat"],
        "token_logprobs": [None, -3.5],
        "top_logprobs": [None, {" dog": -1.0}],
        "text_offset": [0, 3],
    }
