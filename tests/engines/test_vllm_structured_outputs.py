"""The constraint of an engine request (a JSON schema, a regex, a choice, a grammar, the JSON options) as the
fields of vLLM's StructuredOutputsParams, checked without vLLM (tests/engines/test_vllm.py follows one with it)."""

from typing import Any

import pytest

from engines.vllm.engine import structured_outputs
from runtime.protocol import GuidedDecoding, PreprocessedRequest, SamplingOptions, StopConditions

JSON_OPTIONS = GuidedDecoding(whitespace_pattern=" ?", disable_any_whitespace=True, disable_additional_properties=True)


def request(json_schema: str | None = None, guided: GuidedDecoding | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r",
        model="m",
        token_ids=[1, 2],
        sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=4),
        json_schema=json_schema,
        guided=guided,
    )


@pytest.mark.parametrize(
    ("given", "fields"),
    [
        (request(), None),
        (request('{"type": "object"}'), {"json": '{"type": "object"}'}),
        (request(guided=GuidedDecoding(regex="[0-9]+")), {"regex": "[0-9]+"}),
        (request(guided=GuidedDecoding(choice=["yes", "no"])), {"choice": ["yes", "no"]}),
        (request(guided=GuidedDecoding(grammar='root ::= "x"')), {"grammar": 'root ::= "x"'}),
        (
            request('{"type": "object"}', JSON_OPTIONS),
            {
                "json": '{"type": "object"}',
                "whitespace_pattern": " ?",
                "disable_any_whitespace": True,
                "disable_additional_properties": True,
            },
        ),
    ],
)
def test_a_requests_constraint_becomes_vllms_structured_outputs(
    given: PreprocessedRequest, fields: dict[str, Any] | None
) -> None:
    assert structured_outputs(given) == fields
