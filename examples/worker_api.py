"""A distributed worker written with the worker API: it serves the model "shout" on dyn://shout.backend.generate.

Start etcd and NATS (`make services`), an ingress, then this worker:

    flotilla run in=http out=dyn --http-port 8080      # the ingress: serves what workers register
    python examples/worker_api.py                      # ETCD_ENDPOINTS / NATS_SERVER as usual

The ingress picks the model up from etcd and forwards each chat/completion request over NATS to
``handler``, as a plain dict with the fields of runtime.protocol.TextRequest: ``request_id``,
``model``, ``messages`` (chat) or ``prompt`` (completion), ``sampling`` and ``stop_conditions``
(``max_tokens``, ``stop``, ...). The handler yields dicts with the fields of TextOutput: ``text``
and, on the last one, ``finish_reason``. SIGINT/SIGTERM deregister the worker and stop it.
"""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import uvloop

from runtime.config import env_str
from runtime.distributed import DistributedRuntime, register_model, worker
from runtime.logging import configure_logging


def last_user_text(request: dict[str, Any]) -> str:
    if request.get("prompt") is not None:
        return str(request["prompt"])
    for message in reversed(request.get("messages") or []):
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            return str(message["content"])
    return ""


async def handler(request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """Answer in upper case, word by word, within max_tokens (one word is one token here)."""
    words = last_user_text(request).upper().split() or ["..."]
    max_tokens = request["stop_conditions"]["max_tokens"]
    shown = words[:max_tokens]
    finish = "length" if len(words) > len(shown) else "stop"
    for index, word in enumerate(shown):
        await asyncio.sleep(0.01)  # a real engine awaits its model here; never block the event loop
        last = index == len(shown) - 1
        yield {"text": word if index == 0 else " " + word, "finish_reason": finish if last else None}


@worker
async def main(runtime: DistributedRuntime) -> None:
    endpoint = runtime.namespace("shout").component("backend").endpoint("generate")
    # A chat model needs only a name: it takes text, so no tokenizer is registered.
    await register_model("chat", endpoint, model_name="shout")
    await endpoint.serve(handler)  # until SIGINT/SIGTERM


if __name__ == "__main__":
    configure_logging(env_str("FLOTILLA_LOG"))  # info by default: shows what was registered where
    uvloop.run(main())
