"""The 400 for a request field that Flotilla does not act on.

vLLM's server accepts any field and logs the ones it ignores; a client that asks for something this
gateway does not do (``use_beam_search``, ``structured_outputs.structural_tag``) would then get an answer
made without it, and never know. Here the request structs forbid unknown fields (``types.py``): msgspec's
error names the field, and this turns it into a message that says why it is refused. The fields known to
be harmless to ignore are declared on the structs, so they pass (``HARMLESS``, documented in
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
    return InvalidRequest(text, param=shown)
