"""A host-memory KV tier, Flotilla against NVIDIA Dynamo 1.6.1, with mocker workers at speed-up 1.

The trace: ``--documents`` long prompts (``--document-tokens`` each) that come back again and again, each time
with a question of its own (``--question-tokens`` fresh tokens after it), in a random order; the documents
together fill about ``3x`` the fleet's device KV cache (``num_gpu_blocks`` per worker, set so by default),
so a document that comes back has usually been evicted from the device in between. With a host tier
(``num_host_blocks``, room for every document) its blocks were copied to host memory as they were computed
and are brought back (their H2D copy charged) instead of computed again; the KV routers send it to the
worker that holds it, on whichever tier. Without, it is computed again.

    .venv/bin/python bench/kv_tiers_vs_dynamo.py [--workers 2] [--requests 160] [--rounds 3] [--stacks flotilla]

Each stack serves the same trace in a closed loop of ``--concurrency`` streams, ``--max-tokens`` out with
ignore_eos. Each round runs every topology once, in the opposite order to the round before; the figures
compared are the medians over the rounds (this shared machine moves single runs by ±20%).

The floors it checks (issue 37, part 2), against topologies of the same run:

* Flotilla with the host tier: TTFT p50 <= 0.7x Flotilla without it;
* Flotilla with the host tier: TTFT p50 and p99 <= 0.9x Dynamo's mocker stack with the same tier sizes and
  bandwidths.

``--stacks flotilla`` runs Flotilla's topologies alone (where Dynamo is not installed: `make dynamo`).
"""

import argparse
import json
import random
from contextlib import AbstractContextManager
from dataclasses import asdict
from typing import Any

import uvloop
from _common import RESULTS_DIR, percentile
from disagg_vs_dynamo import Row, Topology, closed_loop, run_rounds, verdict
from stacks import STACK_NAMES, Stack, dynamo_stack, flotilla_stack, stack_names

RESULTS = RESULTS_DIR / "kv_tiers_vs_dynamo.json"
VOCABULARY = (100, 40000)
BLOCK = 64
#: SmolLM2-135M's KV in bf16 (30 layers x 2 x 3 KV heads x 64 x 2 B); PCIe-class copies both ways.
KV_BYTES_PER_TOKEN = 23040
HOST_BANDWIDTH_GBPS = 25.0


def mocker_settings(args: argparse.Namespace, *, host_tier: bool) -> dict[str, Any]:
    """The workers' settings: a device cache a third of the documents' blocks over the fleet, and with
    ``host_tier`` a host tier with room for all of them on every worker."""
    document_blocks = args.documents * -(-args.document_tokens // BLOCK)
    device_blocks = max(-(-document_blocks // (3 * args.workers)), 2 * -(-(args.document_tokens + 256) // BLOCK))
    settings: dict[str, Any] = {
        "speedup_ratio": 1.0,
        "block_size": BLOCK,
        "num_gpu_blocks": device_blocks,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
    }
    if host_tier:
        settings |= {
            "num_host_blocks": document_blocks + device_blocks,
            "host_offload_d2h_bandwidth_gbps": HOST_BANDWIDTH_GBPS,
            "host_offload_h2d_bandwidth_gbps": HOST_BANDWIDTH_GBPS,
        }
    return settings


def topologies(args: argparse.Namespace) -> list[Topology]:
    with_host, without = mocker_settings(args, host_tier=True), mocker_settings(args, host_tier=False)
    workers = args.workers

    def flotilla(settings: dict[str, Any]) -> AbstractContextManager[Stack]:
        return flotilla_stack(workers=workers, mocker_settings=settings)

    def dynamo(settings: dict[str, Any]) -> AbstractContextManager[Stack]:
        return dynamo_stack(workers=workers, mocker_settings=settings)

    return [
        Topology("flotilla host tier", "flotilla", lambda: flotilla(with_host)),
        Topology("flotilla device only", "flotilla", lambda: flotilla(without)),
        Topology("dynamo host tier", "dynamo", lambda: dynamo(with_host)),
        Topology("dynamo device only", "dynamo", lambda: dynamo(without)),
    ]


def trace(args: argparse.Namespace, seed: int) -> list[list[int]]:
    """``--requests`` prompts: a document drawn at random (never the one just before), then a fresh question."""
    rng = random.Random(seed)
    documents = [[rng.randrange(*VOCABULARY) for _ in range(args.document_tokens)] for _ in range(args.documents)]
    prompts: list[list[int]] = []
    last = -1
    for _ in range(args.requests):
        pick = rng.choice([number for number in range(args.documents) if number != last])
        last = pick
        prompts.append(documents[pick] + [rng.randrange(*VOCABULARY) for _ in range(args.question_tokens)])
    return prompts


def measure(topology: Topology, args: argparse.Namespace, seed: int) -> Row:
    with topology.start() as stack:
        warm = [list(range(1000 + n, 1000 + n + BLOCK)) for n in range(4)]
        uvloop.run(closed_loop(stack, warm, 2, 4))
        results = uvloop.run(closed_loop(stack, trace(args, seed), args.concurrency, args.max_tokens))
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


def add_trace_flags(parser: argparse.ArgumentParser) -> None:
    """The trace's and the fleet's size (kv_tiers_sim.py replays the same trace)."""
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--documents", type=int, default=12)
    parser.add_argument("--document-tokens", type=int, default=4096)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_flags(parser)
    parser.add_argument("--rounds", type=int, default=3, help="each topology this many times (medians compared)")
    parser.add_argument("--stacks", type=stack_names, default=list(STACK_NAMES))
    args = parser.parse_args()
    settings = mocker_settings(args, host_tier=True)
    print(
        f"{args.requests} requests over {args.documents} documents of {args.document_tokens} tokens (+ "
        f"{args.question_tokens} fresh), {args.max_tokens} out, closed loop of {args.concurrency}, "
        f"{args.workers} workers of {settings['num_gpu_blocks']} device blocks "
        f"(host tier: {settings['num_host_blocks']} blocks at {HOST_BANDWIDTH_GBPS:g} GB/s); mocker at speed-up 1:"
    )
    chosen = [t for t in topologies(args) if t.stack in args.stacks]
    measured, rows = run_rounds(chosen, args.rounds, lambda topology, seed: measure(topology, args, seed))
    checks = []
    host, bare = rows.get("flotilla host tier"), rows.get("flotilla device only")
    dyn_host = rows.get("dynamo host tier")
    if host and bare:
        ttft = host.ttft_p50_ms / bare.ttft_p50_ms
        checks.append(("host tier vs device only", {"ttft_p50": ttft}, ttft <= 0.7))
        print(f"flotilla host tier / device only: TTFT p50 {ttft:.2f}x (<= 0.7)")
    if host and dyn_host:
        p50, p99 = host.ttft_p50_ms / dyn_host.ttft_p50_ms, host.ttft_p99_ms / dyn_host.ttft_p99_ms
        checks.append(("host tier vs dynamo host tier", {"ttft_p50": p50, "ttft_p99": p99}, p50 <= 0.9 and p99 <= 0.9))
        print(f"flotilla host tier / dynamo host tier: TTFT p50 {p50:.2f}x, p99 {p99:.2f}x (<= 0.9)")
    for name, _, ok in checks:
        print(f"  {name}: {verdict(ok)}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "settings": settings,
        "rounds": {name: [asdict(row) for row in runs] for name, runs in measured.items()},
        "medians": [asdict(row) for row in rows.values()],
        "checks": [[n, r, ok] for n, r, ok in checks],
    }
    RESULTS.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
