"""The mistral.rs engine's settings and request translation (no model, no mistralrs package needed)."""

import pytest

from engines.mistralrs import MistralRsSettings, finish_reason, parse_settings, request_fields
from runtime.errors import ConfigError, RequestRejected
from runtime.protocol import SamplingOptions, StopConditions, TextRequest


def text_request(sampling: SamplingOptions | None = None, **stop: int) -> TextRequest:
    return TextRequest(
        request_id="r",
        model="smol",
        prompt="Hi",
        sampling=sampling or SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=16, **stop),  # type: ignore[arg-type]
    )


def test_settings_are_the_runners_arguments_with_its_defaults() -> None:
    assert parse_settings(None) == MistralRsSettings()
    settings = parse_settings('{"max_seqs": 4, "memory_goal": "4GiB", "dtype": "f32", "seed": 3}')
    assert (settings.max_seqs, settings.memory_goal, settings.dtype, settings.seed) == (4, "4GiB", "f32", 3)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"max_seq": 4}', "unknown key 'max_seq' for out=mistralrs; known keys: max_seqs"),
        ('{"max_seqs": 0}', "max_seqs"),
        ('{"dtype": "f8"}', "dtype"),
        ('{"paged_attn": true, "no_paged_attn": true}', "exclude each other"),
        ("[1]", "expected a JSON object"),
        ("{", "not valid JSON"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(raw: str, message: str) -> None:
    with pytest.raises(ConfigError, match="--extra-engine-args") as refused:
        parse_settings(raw)
    assert message in str(refused.value)


def test_sampling_and_length_reach_mistralrs_by_its_names() -> None:
    sampling = SamplingOptions(temperature=0.5, top_p=0.9, top_k=-1, min_p=0.1, repetition_penalty=1.1)
    fields = request_fields(text_request(sampling))
    assert fields["max_tokens"] == 16 and fields["stream"] is True and fields["ignore_eos"] is False
    assert (fields["temperature"], fields["top_p"], fields["min_p"], fields["repetition_penalty"]) == (
        0.5,
        0.9,
        0.1,
        1.1,
    )
    assert fields["top_k"] is None  # OpenAI's -1, "no top-k"
    assert request_fields(text_request(SamplingOptions(top_k=20)))["top_k"] == 20


def test_what_the_python_api_lacks_is_refused_saying_so() -> None:
    with pytest.raises(RequestRejected, match="min_tokens"):
        request_fields(text_request(min_tokens=2))
    with pytest.raises(RequestRejected, match='"seed"'):
        request_fields(text_request(SamplingOptions(seed=1)))


def test_mistralrs_finish_reasons_become_flotillas() -> None:
    assert [finish_reason(reason) for reason in (None, "stop", "length", "canceled", "tool_calls")] == [
        None,
        "stop",
        "length",
        "cancelled",
        "stop",
    ]


def test_every_runner_setting_is_an_argument_of_the_pinned_mistralrs_runner() -> None:
    """The keys of --extra-engine-args that go to mistral.rs's Runner (all but those of its Which) are arguments of
    the installed (pinned) version's Runner: memory_goal among them, which later versions replaced."""
    mistralrs = pytest.importorskip("mistralrs", reason="mistralrs is not installed (`make install` installs it)")
    import inspect

    runner_arguments = set(inspect.signature(mistralrs.Runner).parameters)
    which_arguments = {"dtype", "tok_model_id", "topology"}  # given to Which.GGUF / Which.Plain instead
    assert set(MistralRsSettings.__struct_fields__) - which_arguments <= runner_arguments
    assert "memory_goal" in runner_arguments
