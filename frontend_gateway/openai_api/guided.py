"""vLLM's guided decoding on chat and completions: the constraint a request asks its answer to follow.

vLLM has spelled it two ways, and both are taken: the ``guided_*`` fields (up to 0.11: ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, with ``guided_whitespace_pattern`` and
``guided_decoding_backend``) and ``structured_outputs`` (0.12 on: ``{json, regex, choice, grammar,
json_object}`` with JSON options). One constraint at a time, as vLLM allows, and not with another that holds
the same answer (``response_format`` JSON, a required or named tool call). What the model's engine does not
follow (its card's ``guided_decoding``) is refused naming the field, before any work: an answer that merely
may match a constraint is not one that does.

The constraint travels in the engine request: a JSON schema as ``json_schema`` (as ``response_format``'s),
the rest as ``GuidedDecoding``; the engine turns it into its own (llama.cpp grammars, vLLM's structured
outputs). Whether a regex or a grammar is well-formed only the engine can tell (their dialects are its).
"""

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import msgspec

from frontend_gateway.errors import InvalidRequest
from frontend_gateway.openai_api.types import ChatCompletionRequest, NamedToolChoice, SamplingFields
from runtime.protocol import GuidedDecoding

__all__ = ["Constraint", "guided_constraint"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's guided decoding asks of the engine: a JSON schema (JSON text), or the rest; None: none."""

    json_schema: str | None = None
    guided: GuidedDecoding | None = None


_FREE = Constraint()
# json_object asks for any JSON object: as a schema, this one (as response_format's json_object).
_ANY_OBJECT = '{"type": "object"}'
# The field names by kind, as an error shows them (the client's spelling is named in ``param``).
_LEGACY = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
_ENGINES = "out=llamacpp follows guided_json, guided_choice and guided_grammar, out=vllm all of them"


@dataclass(frozen=True, slots=True)
class _Asked:
    kind: str  # "json", "regex", "choice", "grammar"
    param: str  # the field as the client spelled it
    value: Any


def guided_constraint(request: SamplingFields, *, model: str, follows: Collection[str]) -> Constraint:
    """The constraint ``request`` asks its answer to follow, on a model whose engine follows the kinds ``follows``
    (``ModelCard.guided_decoding``; empty: none).

    Raises InvalidRequest naming the field: two constraints, two spellings of one, a constraint with another that
    holds the same answer, a value of the wrong shape, or a kind the engine does not follow.
    """
    _check_backend(request.guided_decoding_backend)
    asked, options = _asked(request)
    if not asked:
        return _FREE
    if len(asked) > 1:
        raise InvalidRequest(
            f"only one kind of guided decoding at a time, as in vLLM: {asked[0].param} and {asked[1].param} were "
            "both given; send one",
            param=asked[1].param,
        )
    [constraint] = asked
    _refuse_a_second_holder(request, constraint.param)
    for kind, param in [(constraint.kind, constraint.param), *((kind, param) for kind, (param, _) in options.items())]:
        if kind not in follows:
            raise InvalidRequest(_not_followed(model, param, kind, follows), param=param)
    whitespace = options.get("whitespace_pattern", (None, None))[1]
    if options and constraint.kind != "json":
        param = next(iter(options.values()))[0]
        raise InvalidRequest(
            f"{param} shapes a JSON answer, and {constraint.param} asks for none; leave it out", param=param
        )
    if constraint.kind == "json":
        schema = _schema_text(constraint)
        guided = GuidedDecoding(
            whitespace_pattern=whitespace,
            disable_any_whitespace="disable_any_whitespace" in options,
            disable_additional_properties="disable_additional_properties" in options,
        )
        return Constraint(schema, guided if options else None)
    if constraint.kind == "choice":
        return Constraint(guided=GuidedDecoding(choice=list(constraint.value)))
    if not constraint.value:
        raise InvalidRequest(f"{constraint.param} must not be empty", param=constraint.param)
    if constraint.kind == "regex":
        return Constraint(guided=GuidedDecoding(regex=constraint.value))
    return Constraint(guided=GuidedDecoding(grammar=constraint.value))


def _check_backend(backend: str | None) -> None:
    # The engine's backend follows the constraint whatever a request names: asking for another would go unheard.
    if backend is not None and backend != "auto":
        raise InvalidRequest(
            "guided_decoding_backend is not chosen per request here: each engine follows guided decoding with its "
            "own (llama.cpp its grammars; vLLM the worker's structured_outputs_config backend); leave it out or "
            "set it to auto",
            param="guided_decoding_backend",
        )


def _asked(request: SamplingFields) -> tuple[list[_Asked], dict[str, tuple[str, Any]]]:
    """The constraints the request gives, in either spelling, and the JSON options ({kind: (param, value)})."""
    legacy = [
        _Asked(kind, param, value) for kind, param in _LEGACY.items() if (value := getattr(request, param)) is not None
    ]
    options: dict[str, tuple[str, Any]] = {}
    if request.guided_whitespace_pattern is not None:
        options["whitespace_pattern"] = ("guided_whitespace_pattern", request.guided_whitespace_pattern)
    spelled = request.structured_outputs
    if spelled is None:
        return legacy, options
    if legacy or options:
        param = legacy[0].param if legacy else "guided_whitespace_pattern"
        raise InvalidRequest(
            f"{param} and structured_outputs are two spellings of guided decoding (vLLM's before and after 0.12); "
            "send one",
            param=param,
        )
    asked = [
        _Asked(kind, f"structured_outputs.{kind}", value)
        for kind in ("json", "regex", "choice", "grammar")
        if (value := getattr(spelled, kind)) is not None
    ]
    if spelled.json_object:
        asked.append(_Asked("json", "structured_outputs.json_object", None))
    if spelled.whitespace_pattern is not None:
        options["whitespace_pattern"] = ("structured_outputs.whitespace_pattern", spelled.whitespace_pattern)
    if spelled.disable_any_whitespace:
        options["disable_any_whitespace"] = ("structured_outputs.disable_any_whitespace", True)
    if spelled.disable_additional_properties:
        options["disable_additional_properties"] = ("structured_outputs.disable_additional_properties", True)
    if not asked:
        raise InvalidRequest(
            "structured_outputs needs one constraint: json, regex, choice, grammar or json_object",
            param="structured_outputs",
        )
    return asked, options


def _refuse_a_second_holder(request: SamplingFields, param: str) -> None:
    """Refuse a constraint given with another that holds the same answer: it cannot follow both."""
    if request.response_format is not None and request.response_format.get("type", "text") != "text":
        raise InvalidRequest(
            f"response_format and {param} would both constrain the answer; send one", param="response_format"
        )
    if isinstance(request, ChatCompletionRequest) and request.tools is not None:
        choice = request.tool_choice
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise InvalidRequest(
                f"a required or named tool_choice holds the answer to a tool call, which cannot also follow {param}; "
                "send one",
                param="tool_choice",
            )


def _not_followed(model: str, param: str, kind: str, follows: Collection[str]) -> str:
    if not follows:
        return f"model {model!r} cannot follow {param}: its engine has no guided decoding ({_ENGINES}); leave it out"
    followed = ", ".join(_LEGACY.get(name, name) for name in follows if name in _LEGACY)
    text = f"model {model!r} cannot follow {param}: its engine follows {followed} and not this"
    if kind == "regex" and "grammar" in follows:
        # llama.cpp: its regex-to-grammar conversion is partial (engines/llamacpp/guided.py).
        return text + " (a regex is not converted to its grammars: some would be followed wrongly); use a grammar"
    return text + "; leave it out"


def _schema_text(constraint: _Asked) -> str:
    """The JSON schema of a JSON constraint, as JSON text. Raises InvalidRequest unless it is a JSON object."""
    value = constraint.value
    if value is None:  # json_object: any object
        return _ANY_OBJECT
    if isinstance(value, str):
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError as exc:
            raise InvalidRequest(
                f"{constraint.param} is a JSON schema, an object or its JSON text, and this text is not JSON: {exc}",
                param=constraint.param,
            ) from exc
    if not isinstance(value, dict):
        raise InvalidRequest(f"{constraint.param} is a JSON schema: a JSON object", param=constraint.param)
    return msgspec.json.encode(value).decode()
