"""The 400 for a request field that Flotilla does not act on.

vLLM's server accepts any field and logs the ones it ignores; a client that asks for a constraint this
gateway does not have (``guided_json``, ``guided_choice``) would then get an unconstrained answer, and
never know. Here the request structs forbid unknown fields (``types.py``): msgspec's error names the
field, and this turns it into a message that says why it is refused and what to do instead. The fields
known to be harmless to ignore are declared on the structs, so they pass (``HARMLESS``, documented in
docs/openai-api.md).
"""

import re

from frontend_gateway.errors import InvalidRequest

__all__ = ["HARMLESS", "refusal"]

#: Accepted and ignored: none of them changes what the answer is (types.py declares them).
HARMLESS = {
    "chat and completions": (
        "store",
        "metadata",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "prediction",
        "user",
        "stream_options.include_obfuscation",
    ),
    "chat messages": ("refusal", "annotations", "audio", "function_call: null"),
    "responses": ("store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "user"),
    "embeddings": ("user",),
}

_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`(?: - at `\$\.?(?P<path>[^`]*)`)?$")

# What a client asking for these wants, and where Flotilla has it.
_INSTEAD = {
    "guided_json": "response_format json_schema (on an engine that constrains output, out=llamacpp)",
    "guided_regex": None,
    "guided_choice": "response_format json_schema with an enum (on out=llamacpp)",
    "guided_grammar": None,
    "guided_decoding_backend": None,
    "structured_outputs": "response_format json_schema (on out=llamacpp)",
    "guided_whitespace_pattern": None,
}


def refusal(message: str) -> InvalidRequest | None:
    """The InvalidRequest for msgspec's "unknown field" ``message``, naming the field; None for another."""
    match = _UNKNOWN.match(message)
    if match is None:
        return None
    field, path = match["field"], match["path"]
    param = f"{path}.{field}" if path else field
    shown = param if len(param) <= 100 else param[:100] + "..."  # a client may send a megabyte-long name
    text = (
        f"{shown} is not supported here, and is refused rather than ignored: the answer would be made "
        "without it; leave it out"
    )
    if field in _INSTEAD:
        instead = _INSTEAD[field]
        text = f"{shown} (guided decoding) is not supported here: the answer would not follow it; " + (
            f"use {instead}, or leave it out" if instead else "leave it out"
        )
    return InvalidRequest(text, param=shown)
