"""A token-level engine in one Python file: it answers with the prompt's token ids in reverse order.

    flotilla run in=http out=pytok:examples/pytok_countdown.py   # MODEL: SmolLM2 by default

Flotilla does the OpenAI part: it applies the model's chat template, tokenizes, and detokenizes what
this function yields (MODEL gives the tokenizer and template, as for out=echo_core). ``request`` is
the preprocessed request as plain data::

    {"request_id": "...", "model": "...", "token_ids": [1, 9690, ...],
     "sampling": {"temperature": 0.5, ...},            # only the fields the client set
     "stop_conditions": {"max_tokens": 16, ...},        # also min_tokens, stop, ignore_eos when set
     "eos_token_ids": [2], "migrated_tokens": 0}

Yield lists of token ids, or dicts ``{"token_ids": [...], "finish_reason": "stop" | "length"}``.
Stopping at an EOS token is up to the function (this one does not: the reversed prompt contains them,
and the special tokens are left out of the answer's text anyway).
"""

from collections.abc import AsyncIterator
from typing import Any


async def generate(request: dict[str, Any]) -> AsyncIterator[list[int] | dict[str, Any]]:
    tokens = list(reversed(request["token_ids"]))
    # Honour max_tokens ourselves, so the last step carries the right finish reason (Flotilla would
    # also cut the stream there, but a well-behaved engine does no work past it).
    max_tokens = request["stop_conditions"]["max_tokens"]
    shown = tokens[:max_tokens]
    finish = "length" if len(tokens) > len(shown) else "stop"
    for index, token in enumerate(shown):
        if index == len(shown) - 1:
            yield {"token_ids": [token], "finish_reason": finish}
        else:
            yield [token]
