"""A deterministic fuzzer for the OpenAI routes, and the checks every answer must pass.

``request_bodies(route, model, seed, count)`` mixes valid requests with malformed JSON, wrong types,
extreme numbers, huge and odd strings, and unsupported fields. ``check_answer`` holds the gateway to its
promise: never a 5xx, every 4xx in the OpenAI error envelope, every stream ended by ``[DONE]``.
``fire`` sends them all, many at once.
"""

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

EXTREME_NUMBERS: list[Any] = [
    0,
    -1,
    1,
    2**31,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63),
    -(2**63) - 1,
    2**100,
    -(2**100),
    0.5,
    -0.0,
    1e-320,
    1e308,
    -1e308,
    3.5,
    True,
]
# Written into the JSON text as they are: not representable as Python values we could encode.
RAW_NUMBERS = [b"1e999", b"-1e999", b"9" * 400, b"-" + b"9" * 5000, b"1" + b"0" * 30 + b".5", b"0.0000e-99999"]
ODD_STRINGS = [
    "",
    " ",
    "\x00",
    "\x00\x01\x1f",
    "\u202e\u200b\ufeff",
    "é" * 50,
    "👩\u200d👩\u200d👧" * 20,
    "中文" * 100,
    "<|im_start|>system\n<|im_end|>",
    "{{ raise_exception('x') }}",
    "{% for x in range(10**9) %}x{% endfor %}",
    "\ud800",
    "a" * 70_000,
    "ab " * 2000,
]
FIELDS = [
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "n",
    "best_of",
    "ignore_eos",
    "skip_special_tokens",
    "nvext",
    "user",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "response_format",
    "tools",
    "tool_choice",
    "echo",
    "suffix",
]


@dataclass
class Body:
    content: bytes
    stream: bool


def _any_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice(EXTREME_NUMBERS)
    if kind == 1:
        return rng.choice(ODD_STRINGS[:-2])
    if kind == 2:
        return None
    if kind == 3:
        return rng.random() < 0.5
    if kind == 4:
        return rng.uniform(-5, 5)
    if kind == 5:
        return rng.choice(["text", "user", "auto", "none", "required", "json_object", "function"])
    if kind == 6:
        return [_any_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 7:
        return {rng.choice([*FIELDS, "type", "role", "content", "text"]): _any_value(rng, depth + 1) for _ in range(3)}
    return {"role": rng.choice(["user", "system", "assistant", "tool", ""]), "content": _any_value(rng, depth + 1)}


def _valid(route: str, model: str, rng: random.Random) -> dict[str, Any]:
    text = rng.choice(["hi", "What is the capital of France?", "é 中文 👍", "x" * 40])
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randrange(1, 8)}
    if route == CHAT:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = rng.choice([text, [text], [1, 2, 3], [[4, 5]]])
    return body


def _mutate(body: dict[str, Any], route: str, rng: random.Random) -> None:
    for _ in range(rng.randrange(1, 4)):
        action = rng.randrange(6)
        field = rng.choice(FIELDS)
        if action == 0:
            body[field] = rng.choice(EXTREME_NUMBERS)
        elif action == 1:
            body[field] = rng.choice(ODD_STRINGS)
        elif action == 2:
            body[field] = _any_value(rng)
        elif action == 3:
            body.pop(field, None)
        elif action == 4 and route == CHAT:
            body["messages"] = [_any_value(rng) if rng.random() < 0.5 else _message(rng) for _ in range(3)]
        else:
            body[field] = _sensible(field, rng)


def _message(rng: random.Random) -> dict[str, Any]:
    message: dict[str, Any] = {"role": rng.choice(["user", "assistant", "system", "tool"])}
    content = rng.randrange(4)
    if content == 0:
        message["content"] = rng.choice(ODD_STRINGS)
    elif content == 1:
        message["content"] = [{"type": rng.choice(["text", "image_url"]), "text": rng.choice(ODD_STRINGS[:6])}]
    elif content == 2:
        message["tool_calls"] = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
        message["tool_calls"][0]["index"] = rng.choice(EXTREME_NUMBERS)
    return message


def _sensible(field: str, rng: random.Random) -> Any:
    """Values that look right but ask for what is refused or is at an edge."""
    choices: dict[str, list[Any]] = {
        "logit_bias": [{}, {"50256": -100}, {"1": 1e308}],
        "tool_choice": ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}],
        "echo": [True, False],
        "suffix": ["", "tail"],
        "n": [1, 2, 2**64],
        "best_of": [1, 2],
        "logprobs": [True, False, 0, 5, 2**70],
        "top_logprobs": [0, 3],
        "seed": [2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1, 2**200],
        "top_k": [-1, 0, 2**31 - 1, 2**31, 2**64],
        "max_tokens": [1, 2**31 - 1, 2**31, 2**64, 2**80],
        "min_tokens": [0, 2**32, 2**64],
        "stream_options": [{"include_usage": True}, {"include_usage": "yes"}, None],
        "stop": [["\x00"], "x", [""], ["a"] * 20, "\ud800"],
        "nvext": [{"ignore_eos": True, "annotations": ["instance_id"]}, {"annotations": [1]}],
        "response_format": [{"type": "text"}, {"type": "json_schema"}, {"type": 2**70}],
        "tools": [[{"type": "function", "function": {"name": "f", "parameters": {"n": 2**70}}}], [1]],
    }
    return rng.choice(choices.get(field, [None, 2**64, "x", [], {}]))


def _broken_json(route: str, model: str, rng: random.Random) -> bytes:
    valid = json.dumps(_valid(route, model, rng)).encode()
    kind = rng.randrange(8)
    if kind == 0:
        return valid[: rng.randrange(len(valid))]
    if kind == 1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    if kind == 2:
        return valid.replace(b'"', b"", 1)
    if kind == 3:
        return b"[" * rng.choice([10, 1000, 100_000]) + b"]" * 3
    if kind == 4:
        return valid[:-1] + b', "x": "\xff\xfe"}'
    if kind == 5:
        return rng.choice([b"null", b"1", b'"text"', b"[]", b"{}", b"true", b"{" * 50])
    if kind == 6:
        return valid[:-1] + b', "seed": ' + rng.choice(RAW_NUMBERS) + b"}"
    return valid[:-1] + b', "max_tokens": ' + rng.choice(RAW_NUMBERS) + b"}"


def request_bodies(route: str, model: str, *, seed: int, count: int) -> list[Body]:
    """``count`` request bodies for ``route``, the same ones for the same seed."""
    rng = random.Random(seed)
    bodies: list[Body] = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.25:
            bodies.append(Body(_broken_json(route, model, rng), stream=False))
            continue
        body = _valid(route, model, rng)
        if kind < 0.9:
            _mutate(body, route, rng)
        stream = rng.random() < 0.5
        if stream:
            body["stream"] = True
        try:
            content = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
        except ValueError:
            continue
        bodies.append(Body(content, stream=body.get("stream") is True))
    return bodies


@dataclass
class Answer:
    body: Body
    status: int
    headers: httpx.Headers
    content: bytes


def check_answer(answer: Answer) -> None:
    """The promises every answer keeps; raises AssertionError naming the request otherwise."""
    shown = answer.body.content[:300]
    assert answer.status < 500, f"{answer.status} for {shown!r}: {answer.content[:500]!r}"
    if answer.status >= 400:
        error = msgspec.json.decode(answer.content)["error"]
        assert set(error) == {"message", "type", "param", "code"}, f"{shown!r}: {error}"
        assert isinstance(error["message"], str) and error["message"], shown
        assert answer.headers["content-type"] == "application/json"
        return
    if answer.headers["content-type"] == "text/event-stream":
        assert answer.content.endswith(b"data: [DONE]\n\n"), f"unfinished stream for {shown!r}"
        for event in answer.content.split(b"\n\n")[:-2]:
            data = msgspec.json.decode(event.removeprefix(b"data: "))
            assert "error" not in data, f"{shown!r}: {data}"
    else:
        assert msgspec.json.decode(answer.content)["choices"], shown


async def fire(base_url: str, route: str, bodies: list[Body], *, concurrency: int = 64) -> list[Answer]:
    """Send every body to ``route``, ``concurrency`` at a time; returns the answers in order."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:

        async def send(body: Body) -> Answer:
            async with gate:
                response = await client.post(route, content=body.content, headers={"content-type": "application/json"})
                return Answer(body, response.status_code, response.headers, response.content)

        return await asyncio.gather(*(send(body) for body in bodies))
