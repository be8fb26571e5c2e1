"""Disaggregated prefill/decode, Flotilla against NVIDIA Dynamo 1.6.1, with mocker workers at speed-up 1.

Each topology is a whole stack (bench/stacks.py) started in turn on this machine: one prefill and one decode
worker (plain: every prompt on the prefill worker; conditional: the ingress may keep a prompt on the decode
worker), and Flotilla's own two aggregated workers. The load is issue 37's: ``--requests`` distinct
``--tokens``-token prompts (no prefix shared), ``--max-tokens`` tokens out with ignore_eos, in a closed loop of
``--concurrency`` streams (each sends its next request when its last one ends). TTFT and ITL (the gaps between
text chunks) are what the client saw; tokens/s says little here, since the mocker's decode step does not grow
with the batch.

    .venv/bin/python bench/disagg_vs_dynamo.py [--requests 200] [--concurrency 32] [--rounds 3] [--stacks flotilla]

Each round runs every topology once, in the opposite order to the round before, on prompts of its own; the
figures compared are the medians over the rounds (this shared machine moves single runs by ±20%).

"conditional" is Flotilla's default conditional policy, ``isl`` (Dynamo's own default, ``isl_bounding``);
"load" is its ``prefill_load`` counterpart, shown beside it with the same busy threshold (``--busy``).

The floors it checks (issue 37, part 1), each against a topology of the same run:

* conditional 1P+1D: TTFT p50 <= 0.8x Dynamo's 1P+1D with its ``prefill_load`` policy, ITL p99 <= 1.0x;
* plain 1P+1D: TTFT p50 and ITL p99 <= 1.0x Dynamo's plain 1P+1D;
* conditional 1P+1D: TTFT p50 below Flotilla's own two aggregated workers.

``--stacks flotilla`` runs Flotilla's topologies alone (where Dynamo is not installed: `make dynamo`).
"""

import argparse
import asyncio
import json
import random
import statistics
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any

import uvloop
from _common import RESULTS_DIR, percentile
from stacks import STACK_NAMES, Stack, dynamo_stack, flotilla_stack, stack_names
from trace_replay import StreamResult, http_request, read_stream

RESULTS = RESULTS_DIR / "disagg_vs_dynamo.json"
VOCABULARY = (100, 40000)
#: SmolLM2-135M's KV in bf16 (30 layers x 2 x 3 KV heads x 64 x 2 B), over InfiniBand-class 64 GB/s.
MOCKER_SETTINGS: dict[str, Any] = {"speedup_ratio": 1.0, "kv_transfer_bandwidth": 64.0, "kv_bytes_per_token": 23040}


@dataclass(frozen=True)
class Topology:
    name: str
    stack: str  # "flotilla" or "dynamo"
    start: Callable[[], AbstractContextManager[Stack]]


@dataclass
class Row:
    topology: str
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    wall_s: float


def topologies(busy_threshold: float) -> list[Topology]:
    settings = MOCKER_SETTINGS
    load_policy = {"policy": "prefill_load", "prefill_busy_threshold": busy_threshold}
    dynamo_conditional = ["--router-conditional-disagg", "--router-conditional-disagg-config", json.dumps(load_policy)]
    flotilla_load = ["--disagg-policy", "load", "--disagg-prefill-busy", str(busy_threshold)]
    return [
        Topology("flotilla 2 aggregated", "flotilla", lambda: flotilla_stack(workers=2, mocker_settings=settings)),
        Topology("flotilla 1P+1D", "flotilla", lambda: flotilla_stack(disagg=(1, 1), mocker_settings=settings)),
        Topology(
            "flotilla 1P+1D conditional",
            "flotilla",
            lambda: flotilla_stack(disagg=(1, 1), mocker_settings=settings, ingress_args=["--disagg-policy", "isl"]),
        ),
        Topology(
            "flotilla 1P+1D load",
            "flotilla",
            lambda: flotilla_stack(disagg=(1, 1), mocker_settings=settings, ingress_args=flotilla_load),
        ),
        Topology("dynamo 1P+1D", "dynamo", lambda: dynamo_stack(disagg=(1, 1), mocker_settings=settings)),
        Topology(
            "dynamo 1P+1D prefill_load",
            "dynamo",
            lambda: dynamo_stack(disagg=(1, 1), mocker_settings=settings, frontend_args=dynamo_conditional),
        ),
    ]


def prompts(count: int, tokens: int, seed: int) -> Iterator[list[int]]:
    rng = random.Random(seed)
    for _ in range(count):
        yield [rng.randrange(*VOCABULARY) for _ in range(tokens)]


async def closed_loop(stack: Stack, batch: list[list[int]], concurrency: int, max_tokens: int) -> list[StreamResult]:
    """Every prompt of ``batch``, ``concurrency`` streams at a time, each on a keep-alive connection of its own."""
    queue = list(reversed(batch))
    results: list[StreamResult] = []

    async def stream() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
        try:
            while queue:
                body = {"model": stack.model, "prompt": queue.pop(), "max_tokens": max_tokens, "stream": True}
                request = http_request(stack.port, "/v1/completions", body | {"ignore_eos": True}, keep_alive=True)
                result = await read_stream(reader, writer, request)
                if result.error is not None or len(result.token_times) < 2:
                    raise RuntimeError(f"{stack.name}: a request failed: {result.error or 'too few chunks'}")
                results.append(result)
        finally:
            writer.close()

    await asyncio.gather(*(stream() for _ in range(concurrency)))
    return results


def measure(topology: Topology, args: argparse.Namespace, seed: int) -> Row:
    with topology.start() as stack:
        uvloop.run(closed_loop(stack, list(prompts(4, args.tokens, seed=1)), 4, args.max_tokens))  # warm-up
        batch = list(prompts(args.requests, args.tokens, seed=seed))
        results = uvloop.run(closed_loop(stack, batch, args.concurrency, args.max_tokens))
    ttfts = [result.ttft * 1000 for result in results]
    gaps = [gap * 1000 for result in results for gap in result.gaps()]
    wall = max(result.finished for result in results) - min(result.sent for result in results)
    return Row(
        topology.name,
        len(results),
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        percentile(gaps, 50),
        percentile(gaps, 99),
        wall,
    )


def median_row(rows: list[Row]) -> Row:
    """Each figure's median over ``rows`` (one topology's rounds)."""
    return Row(
        rows[0].topology,
        rows[0].requests,
        *(statistics.median(getattr(row, name) for row in rows) for name in _FIGURES),
    )


_FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "wall_s")


def show(rows: Iterable[Row]) -> None:
    print(f"{'topology':<30}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}{'wall s':>8}")
    for row in rows:
        print(
            f"{row.topology:<30}{row.ttft_p50_ms:>10.1f}{row.ttft_p99_ms:>8.1f}{row.itl_p50_ms:>9.2f}"
            f"{row.itl_p99_ms:>8.2f}{row.wall_s:>8.2f}",
            flush=True,
        )


def run_rounds(
    chosen: list[Topology], rounds: int, measure_one: Callable[[Topology, int], Row]
) -> tuple[dict[str, list[Row]], dict[str, Row]]:
    """Each topology measured once a round (``measure_one(topology, seed)``, seed 2, 3, ... by round), in the
    opposite order to the round before, each round's rows printed; returns every round's rows by topology and
    their medians."""
    measured: dict[str, list[Row]] = {t.name: [] for t in chosen}
    for number in range(rounds):
        order = chosen if number % 2 == 0 else list(reversed(chosen))
        print(f"round {number + 1}:")
        round_rows = {t.name: measure_one(t, 2 + number) for t in order}
        show(round_rows[t.name] for t in chosen)
        for name, row in round_rows.items():
            measured[name].append(row)
    rows = {name: median_row(runs) for name, runs in measured.items()}
    print(f"medians of {rounds} round(s):")
    show(rows.values())
    return measured, rows


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--busy", type=float, default=1.0, help="conditional: prefill busy threshold, a share of its batch budget"
    )
    parser.add_argument("--rounds", type=int, default=3, help="each topology this many times (medians compared)")
    parser.add_argument("--stacks", type=stack_names, default=list(STACK_NAMES))
    args = parser.parse_args()
    print(
        f"{args.requests} requests of {args.tokens} distinct tokens, {args.max_tokens} out (ignore_eos), "
        f"closed loop of {args.concurrency}; mocker at speed-up 1:"
    )
    chosen = [t for t in topologies(args.busy) if t.stack in args.stacks]
    measured, rows = run_rounds(chosen, args.rounds, lambda topology, seed: measure(topology, args, seed))
    checks = []
    cond, plain = rows.get("flotilla 1P+1D conditional"), rows.get("flotilla 1P+1D")
    dyn_load, dyn_plain = rows.get("dynamo 1P+1D prefill_load"), rows.get("dynamo 1P+1D")
    agg = rows.get("flotilla 2 aggregated")
    if cond and dyn_load:
        ttft, itl = cond.ttft_p50_ms / dyn_load.ttft_p50_ms, cond.itl_p99_ms / dyn_load.itl_p99_ms
        ratios = {"ttft_p50": ttft, "itl_p99": itl}
        checks.append(("conditional vs dynamo prefill_load", ratios, ttft <= 0.8 and itl <= 1))
        print(f"conditional / dynamo prefill_load: TTFT p50 {ttft:.2f}x (<= 0.8), ITL p99 {itl:.2f}x (<= 1.0)")
    if plain and dyn_plain:
        ttft, itl = plain.ttft_p50_ms / dyn_plain.ttft_p50_ms, plain.itl_p99_ms / dyn_plain.itl_p99_ms
        checks.append(("plain vs dynamo plain", {"ttft_p50": ttft, "itl_p99": itl}, ttft <= 1 and itl <= 1))
        print(f"plain 1P+1D / dynamo plain: TTFT p50 {ttft:.2f}x (<= 1.0), ITL p99 {itl:.2f}x (<= 1.0)")
    if cond and agg:
        ttft = cond.ttft_p50_ms / agg.ttft_p50_ms
        checks.append(("conditional vs flotilla aggregated", {"ttft_p50": ttft}, ttft < 1))
        print(f"conditional / flotilla 2 aggregated: TTFT p50 {ttft:.2f}x (< 1.0)")
    for name, _, ok in checks:
        print(f"  {name}: {verdict(ok)}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "rounds": {name: [asdict(row) for row in runs] for name, runs in measured.items()},
        "medians": [asdict(row) for row in rows.values()],
        "checks": [[n, r, ok] for n, r, ok in checks],
    }
    RESULTS.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
