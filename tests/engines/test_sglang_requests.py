"""What SGLang is given for a request, and what a request it refuses becomes: ``min_tokens``, guided decoding, log
probabilities, incremental streaming and SGLang's ValueErrors, against the stand-in of tests/engines/test_sglang.py."""

import json
from pathlib import Path
from typing import Any

import pytest

from engines.sglang.engine import engine_kwargs
from engines.sglang.requests import token_logprobs
from engines.shared.gpu_engine_args import GpuPlacement
from engines.shared.grammar_constraints import GUIDED_KINDS, choice_regex
from runtime.engine import RequestContext
from runtime.errors import RequestRejected
from runtime.protocol import GuidedDecoding, StopConditions, TokenLogprob
from tests.engines.test_sglang import FakeSglang, chunk, request, started_engine

LENGTH = {"type": "length", "length": 2}


async def answer(fake: FakeSglang, **fields: Any) -> list[Any]:
    given = request()
    for name, value in fields.items():
        setattr(given, name, value)
    return [output async for output in started_engine(fake).generate(given, RequestContext("r1"))]


async def test_min_tokens_is_refused_naming_the_field_before_sglang_sees_it() -> None:
    """SGLang 0.5's ``SamplingParams.normalize`` (python/sglang/srt/sampling/sampling_params.py,
    ``raise_if_tokenizer_required``) refuses ``min_new_tokens`` with ``skip_tokenizer_init``; before it, the
    scheduler's ``BatchedMinNewTokensPenalizer`` (penaltylib/min_new_tokens.py) read ``req.tokenizer.eos_token_id``
    and took the engine down. Either way it must not reach SGLang."""
    fake = FakeSglang([chunk([5], 1, LENGTH)])
    with pytest.raises(RequestRejected, match=r"min_tokens \(2\) cannot be honoured by out=sglang"):
        await answer(fake, stop_conditions=StopConditions(max_tokens=8, min_tokens=2))
    assert fake.calls == []
    # With ignore_eos no EOS ends the answer: min_tokens asks nothing, and the request runs.
    outputs = await answer(fake, stop_conditions=StopConditions(max_tokens=8, min_tokens=2, ignore_eos=True))
    assert fake.calls[0]["sampling_params"]["min_new_tokens"] == 0 and outputs[-1].finish_reason == "length"


async def test_a_valueerror_of_sglangs_request_checks_is_a_rejection_with_its_message() -> None:
    """SGLang's ``TokenizerManager._validate_one_request`` raises ValueError for a prompt over the context length,
    ``SamplingParams.verify`` for a bad value: the client's error (a 400), not the engine's."""
    fake = FakeSglang([], refuse="The input (9000 tokens) is longer than the model's context length (8192 tokens).")
    with pytest.raises(RequestRejected, match=r"SGLang refused the request: The input \(9000 tokens\) is longer"):
        await answer(fake)
    assert fake.aborted == []


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"json_schema": '{"type": "object"}'}, {"json_schema": '{"type": "object"}'}),
        ({"guided": GuidedDecoding(regex="[0-9]+")}, {"regex": "[0-9]+"}),
        ({"guided": GuidedDecoding(grammar='root ::= "yes" | "no"')}, {"ebnf": 'root ::= "yes" | "no"'}),
        ({"guided": GuidedDecoding(choice=["yes", "no (maybe)"])}, {"regex": r"(yes|no \(maybe\))"}),
    ],
)
async def test_guided_decoding_reaches_sglangs_sampling_params(
    fields: dict[str, Any], expected: dict[str, str]
) -> None:
    """SGLang's ``SamplingParams`` take one of ``json_schema``, ``regex`` and ``ebnf`` (``verify``), followed by
    its grammar backend; a choice is the regex that matches exactly its strings."""
    fake = FakeSglang([chunk([5], 1, LENGTH)])
    await answer(fake, **fields)
    given = fake.calls[0]["sampling_params"]
    assert {name: given[name] for name in ("json_schema", "regex", "ebnf") if name in given} == expected
    assert set(GUIDED_KINDS) == {"json", "regex", "choice", "grammar"}


def test_a_choices_regex_matches_exactly_its_strings() -> None:
    import re

    pattern = choice_regex(["a.b", "c|d", "e*"])
    assert [bool(re.fullmatch(pattern, text)) for text in ["a.b", "c|d", "e*", "axb", "c", "eee"]] == [
        True, True, True, False, False, False,
    ]  # fmt: skip


async def test_log_probabilities_are_asked_of_sglang_and_read_from_each_chunk() -> None:
    """``Engine.async_generate(return_logprob=True, top_logprobs_num=N)``: each chunk's ``meta_info`` has
    ``output_token_logprobs`` (``(logprob, token_id, text)``) and ``output_top_logprobs`` (a list of them per
    token), of the whole output so far (or of the chunk's tokens with incremental streaming)."""
    first = chunk(
        [5], 1, output_token_logprobs=[(-0.5, 5, None)], output_top_logprobs=[[(-0.5, 5, None), (-1.5, 9, None)]]
    )
    last = chunk(
        [5, 6], 2, LENGTH, output_token_logprobs=[(-0.5, 5, None), (-0.25, 6, None)],
        output_top_logprobs=[[(-0.5, 5, None), (-1.5, 9, None)], [(-0.25, 6, None), (-2.0, 3, None)]],
    )  # fmt: skip
    fake = FakeSglang([first, last])
    outputs = await answer(fake, logprobs=1)
    assert (fake.calls[0]["return_logprob"], fake.calls[0]["top_logprobs_num"]) == (True, 1)
    assert [output.logprobs for output in outputs] == [
        [TokenLogprob(-0.5, [(5, -0.5)])],
        [TokenLogprob(-0.25, [(6, -0.25)])],
    ]
    assert token_logprobs({}, 1, 1) is None
    plain = FakeSglang([chunk([5], 1, LENGTH)])
    await answer(plain)
    assert "return_logprob" not in plain.calls[0]


def test_sglang_streams_each_chunks_new_tokens_only() -> None:
    """Without ``incremental_streaming_output`` (ServerArgs, python/sglang/srt/server_args.py) SGLang's tokenizer
    manager copies the whole output list into every chunk: quadratic in the answer's length."""
    kwargs = engine_kwargs(Path("/m"), GpuPlacement(), {}, kv_events_endpoint=None)
    assert kwargs["incremental_streaming_output"] is True
    given = engine_kwargs(Path("/m"), GpuPlacement(), {"incremental_streaming_output": False}, kv_events_endpoint=None)
    assert given["incremental_streaming_output"] is False  # the worker's own choice stands
    assert json.dumps(kwargs)
