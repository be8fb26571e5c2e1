"""TensorRT-LLM in disaggregated serving, as Dynamo 1.6.1 runs it (docs/disaggregation.md).

A prefill worker runs the prompt as a ``context_only`` request (``DisaggregatedParams``, TensorRT-LLM's own type);
its output's ``disaggregated_params`` (the context request's id, an opaque state of bytes, the first generated
tokens) go to the decode worker in the handoff, which runs the request as ``generation_only`` with them: the
cache transceiver (``cache_transceiver_config``, TensorRT-LLM's setting) moves the KV between the two. Prefill
first, then decode, as Dynamo orders it.
"""

import base64
from typing import Any

from runtime.errors import ConfigError

#: ``KvHandoff.kind`` of a TensorRT-LLM prefill.
TRTLLM_HANDOFF = "trtllm"
#: The fields of ``DisaggregatedParams`` that travel in a handoff (TensorRT-LLM 1.x).
FIELDS = ("first_gen_tokens", "ctx_request_id", "opaque_state", "draft_tokens", "disagg_request_id", "ctx_dp_rank")


def check_disagg_role(role: str, engine_args: dict[str, Any]) -> None:
    """Raise ConfigError unless a prefill or decode worker's engine args give TensorRT-LLM a cache transceiver."""
    if role in ("prefill", "decode") and not engine_args.get("cache_transceiver_config"):
        raise ConfigError(
            f"--disagg-role {role} with out=trtllm needs a cache transceiver in --extra-engine-args, e.g. "
            "cache_transceiver_config: {backend: DEFAULT} (docs/disaggregation.md)"
        )


def encode_params(params: Any) -> dict[str, Any]:
    """A context request's ``disaggregated_params`` as the handoff's JSON-able params (bytes in base64)."""
    encoded: dict[str, Any] = {}
    for name in FIELDS:
        value = getattr(params, name, None)
        if value is None:
            continue
        encoded[name] = {"base64": base64.b64encode(value).decode()} if isinstance(value, bytes) else value
    return encoded


def generation_params(params: dict[str, Any]) -> dict[str, Any]:
    """``DisaggregatedParams`` arguments of the decode half from a handoff's params. Raises ConfigError when
    the context request's id is missing (Dynamo's frontend refuses such a handoff too)."""
    if params.get("ctx_request_id") is None:
        raise ConfigError("a TensorRT-LLM KV handoff without ctx_request_id")
    decoded: dict[str, Any] = {"request_type": "generation_only"}
    for name in FIELDS:
        if (value := params.get(name)) is not None:
            decoded[name] = base64.b64decode(value["base64"]) if isinstance(value, dict) else value
    return decoded
