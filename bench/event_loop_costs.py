"""What the gateway's per-model and per-request work would cost the event loop, for SmolLM2 135M.

Every open stream shares the gateway's one event loop, so synchronous work of more than about a
millisecond per event delays every token of every stream. This measures, each step on its own:

* when a model appears: decoding its etcd entry, fetching its tokenizer from the NATS object store (the
  longest single stall of the loop during the fetch, not its wall time), building the tokenizer from
  JSON, finding its longest token, compiling the chat template; and, for work that can go to a thread,
  the longest stall of the loop while it runs there (a thread helps only where the GIL is let go);
* per request: rendering the chat template and tokenizing, for a short and a long conversation/prompt.

    .venv/bin/python bench/event_loop_costs.py [--repeat 20]

Starts its own nats-server (JetStream) on a free loopback port. Prints the median and the worst time of
each step in milliseconds.
"""

import argparse
import asyncio
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from _common import nats_server
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.cluster.nats_connection import connect_nats  # noqa: E402
from runtime.cluster.object_store import fetch_tokenizer, publish_tokenizer  # noqa: E402
from runtime.endpoint import ModelEntry  # noqa: E402
from runtime.models.card import ModelCard  # noqa: E402
from runtime.models.chat_template import ChatTemplate  # noqa: E402
from runtime.models.loading import load_model_card  # noqa: E402
from tests.servers import smollm2_path  # noqa: E402

SHORT_PROMPT = "What is the capital of France? Answer in one sentence."
# A paragraph of ordinary English, repeated: about 16 KB is where tokenize() leaves the loop today.
PARAGRAPH = (
    "The harbour was quiet that morning; fishing boats rocked against the pier while gulls argued over "
    "the nets. Somewhere a radio played an old song, and the smell of tar and salt hung in the air. "
)


def conversation(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: {PARAGRAPH}"})
        messages.append({"role": "assistant", "content": f"Answer {turn}: {PARAGRAPH}"})
    messages.append({"role": "user", "content": SHORT_PROMPT})
    return messages


def timed(step: Callable[[], object], repeat: int) -> list[float]:
    """Wall times of ``repeat`` calls of ``step``, in ms."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    return times


def report(label: str, times: list[float]) -> None:
    print(f"{label:<66} {statistics.median(times):9.3f} {max(times):9.3f}")


async def longest_stall(operation: Callable[[], Any]) -> float:
    """Run ``await operation()`` and return the longest time the loop went without a turn, in ms."""
    longest = 0.0
    done = False

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        await operation()
    finally:
        done = True
        await tick
    return longest * 1000


async def fetch_costs(url: str, card: ModelCard, repeat: int) -> tuple[list[float], list[float], list[float]]:
    """Decode times of a model entry, and wall times and longest loop stalls of its tokenizer's fetch."""
    assert card.tokenizer_json is not None
    nc = await connect_nats(url, name="bench-event-loop-costs")
    try:
        digest = await publish_tokenizer(nc, card.tokenizer_json)
        entry = ModelEntry(
            instance_id=1,
            subject="flotilla.bench.backend.generate.1",
            card=msgspec.structs.replace(card, tokenizer_json=None, source=None),
            tokenizer_sha256=digest,
        )
        encoded = msgspec.json.encode(entry)
        decoder = msgspec.json.Decoder(ModelEntry)
        decode = timed(lambda: decoder.decode(encoded), repeat)
        walls, stalls = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            stalls.append(await longest_stall(lambda: fetch_tokenizer(nc, digest)))
            walls.append((time.perf_counter() - start) * 1000)
        return decode, walls, stalls
    finally:
        await nc.close()


async def stalls_on_thread(work: Callable[[], object], repeat: int) -> list[float]:
    """The longest event-loop stall, in ms, while ``work`` runs on a thread (the GIL decides)."""
    return [await longest_stall(lambda: asyncio.to_thread(work)) for _ in range(repeat)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    repeat: int = args.repeat

    card = load_model_card(smollm2_path())
    assert card.tokenizer_json is not None and card.chat_template is not None
    tokenizer_json, source = card.tokenizer_json, card.chat_template
    print(f"SmolLM2 135M: tokenizer JSON {len(tokenizer_json) / 1e6:.1f} MB, chat template {len(source)} chars")
    print(f"{'step':<66} {'median ms':>9} {'max ms':>9}")

    with tempfile.TemporaryDirectory() as directory, nats_server(Path(directory), jetstream=True) as nats_port:
        url = f"nats://127.0.0.1:{nats_port}"
        decode, walls, stalls = asyncio.run(fetch_costs(url, card, repeat))
    report("model entry: decode (msgspec)", decode)
    report("model entry: tokenizer fetch, wall", walls)
    report("model entry: tokenizer fetch, longest loop stall", stalls)

    report("tokenizer: build from JSON (Tokenizer.from_str)", timed(lambda: Tokenizer.from_str(tokenizer_json), repeat))
    tokenizer = Tokenizer.from_str(tokenizer_json)
    report(
        "tokenizer: longest token via get_vocab()",
        timed(lambda: max(len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), repeat),
    )
    fresh = msgspec.structs.replace(card, tokenizer_json=tokenizer_json)
    fresh.__dict__["tokenizer"] = tokenizer

    def longest_token() -> int:
        compute: Callable[[ModelCard], int] = vars(ModelCard)["max_token_chars"].func  # the cached_property's
        return compute(fresh)  # what card.max_token_chars computes, uncached

    report("tokenizer: longest token, token by token (the card's)", timed(longest_token, repeat))
    report(
        "chat template: compile",
        timed(lambda: ChatTemplate(source, bos_token=card.bos_token, eos_token=card.eos_token), repeat),
    )
    for label, work in (
        ("Tokenizer.from_str", lambda: Tokenizer.from_str(tokenizer_json)),
        ("longest token via get_vocab()", lambda: max(map(len, tokenizer.get_vocab(with_added_tokens=True)))),
        ("longest token, token by token", longest_token),
        ("card.prepare(), tokenizer built", lambda: msgspec.structs.replace(card).prepare()),
        ("card.prepare(), tokenizer kept", lambda: msgspec.structs.replace(card).prepare(tokenizer)),
        ("tokenize 16 KB (encode_batch)", lambda: tokenizer.encode_batch([(PARAGRAPH * 100)[:16_384]])),
    ):
        report(f"on a thread, loop stall: {label}", asyncio.run(stalls_on_thread(work, repeat)))
    template = ChatTemplate(source, bos_token=card.bos_token, eos_token=card.eos_token)
    texts = {}
    for label, messages in (("short, 1 message", conversation(0)), ("long, 40 turns", conversation(40))):
        texts[label] = template.render(messages, add_generation_prompt=True)
        chars = len(texts[label])
        render = functools.partial(template.render, messages)
        report(f"chat template: render {label} ({chars} chars)", timed(render, repeat))
    prompts = [("short prompt", SHORT_PROMPT)]
    prompts += [(f"{size // 1024} KB prompt", (PARAGRAPH * 100)[:size]) for size in (1024, 2048, 4096, 16_384)]
    prompts.append(("long chat, 40 turns", texts["long, 40 turns"]))
    for label, text in prompts:
        report(
            f"tokenize: {label} ({len(text)} chars)",
            timed(functools.partial(tokenizer.encode, text, add_special_tokens=False), repeat),
        )


if __name__ == "__main__":
    main()
