"""Which worker holds which KV-cache blocks: the KV router's index.

Blocks are named by their *sequence* hash (runtime/kv/blocks.py), which covers the block's whole
prefix; so the index can be a flat map from hash to the workers (instance id, dp rank) that hold it,
and a request's cache hit on a worker is the number of its leading block hashes found there in a row.
A stored block's parent is therefore not needed to place it: a block stored under a parent the index
never saw is still exactly the block its hash names (a later lookup simply stops at the missing parent).

Two variants answer ``find_matches`` the same way:

* ``KvIndexer`` learns from the workers' KV events (stored, removed, all cleared, and whole-state
  answers); events about blocks it does not know, and duplicates, change nothing. It keeps each tier a
  worker caches on apart (runtime/kv/events.py ``Medium``: the device, host memory, a disk, outside the
  node): ``find_matches`` counts device blocks only, ``find_tiered`` the leading run over every tier with
  how many of its blocks are only on a lower one (routing/kv_scoring.py credits those less).
* ``PredictedKvIndexer`` is for engines that publish no events (``--use-kv-events false``): it assumes
  that a worker keeps the blocks of the requests routed to it for a while (a TTL, 120 s by default),
  and keeps at most a bounded number of them, dropping the least recently routed first.
"""

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

from runtime.kv.events import LOWER_TIERS, AllCleared, BlockRemoved, BlockStored, KvEvent, Medium

#: A worker as the router sees it: (instance id, dp rank).
Worker = tuple[int, int]


class TieredMatch(NamedTuple):
    """A worker's leading run of a prompt's blocks over all its tiers: ``device`` of them on the device,
    ``host`` only in host memory, ``far`` only on a disk or outside the node."""

    device: int
    host: int = 0
    far: int = 0


class WorkerBits:
    """A bit per worker, so that the workers holding a block are one int: a hash -> int map is cheaper to
    walk and to intersect than a hash -> set map, and holds no object the garbage collector must visit
    (an index of 25k blocks kept 25k sets that every full collection walked, 22 ms in the ingress)."""

    def __init__(self) -> None:
        self._bits: dict[Worker, int] = {}
        self._workers: list[Worker | None] = []  # by bit number; None where a bit is free

    def bit(self, worker: Worker) -> int:
        """The bit of ``worker`` (a power of two), given it on first use."""
        bit = self._bits.get(worker)
        if bit is None:
            try:
                number = self._workers.index(None)
                self._workers[number] = worker
            except ValueError:
                number = len(self._workers)
                self._workers.append(worker)
            bit = self._bits[worker] = 1 << number
        return bit

    def release(self, worker: Worker) -> None:
        """Free the bit of ``worker``; no holder mask may still have it set."""
        bit = self._bits.pop(worker, None)
        if bit is not None:
            self._workers[bit.bit_length() - 1] = None

    def known(self) -> list[Worker]:
        """The workers that have a bit."""
        return list(self._bits)

    def workers(self, mask: int) -> Iterator[Worker]:
        """The workers whose bits are set in ``mask``."""
        workers = self._workers
        while mask:
            low = mask & -mask
            worker = workers[low.bit_length() - 1]
            if worker is not None:
                yield worker
            mask ^= low


def leading_matches(holders: dict[int, int], hashes: Sequence[int], bits: WorkerBits) -> dict[Worker, int]:
    """For each worker holding ``hashes[0]``, how many of ``hashes`` it holds in a row from the start.

    ``holders`` maps a block hash to the mask (``bits``) of the workers holding it. Walks the chain once
    and stops as soon as no worker is left, so a miss costs one lookup.
    """
    if not hashes or not (alive := holders.get(hashes[0], 0)):
        return {}
    matches: dict[Worker, int] = {}
    depth = 1
    get = holders.get
    for block_hash in hashes[1:]:
        here = get(block_hash)
        if here is None:
            break
        # Usually every worker still in the walk holds the next block too.
        if (still := alive & here) != alive:
            for worker in bits.workers(alive ^ still):
                matches[worker] = depth
            alive = still
            if not alive:
                return matches
        depth += 1
    for worker in bits.workers(alive):
        matches[worker] = depth
    return matches


def _drop_holder(holders: dict[int, int], block_hash: int, keep: int) -> None:
    """Clear the bits not in ``keep`` from the holders of ``block_hash``; forget the block if none is left."""
    here = holders.get(block_hash)
    if here is None:
        return
    if here := here & keep:
        holders[block_hash] = here
    else:
        del holders[block_hash]


def leading_tiered_matches(
    device: dict[int, int], lower: Sequence[dict[int, int]], hashes: Sequence[int], bits: WorkerBits
) -> dict[Worker, TieredMatch]:
    """For each worker holding ``hashes[0]`` on any tier, its leading run of ``hashes`` over all tiers, and
    how many blocks of the run it holds only on a lower one.

    ``device`` maps a block hash to the mask of the workers holding it on the device; ``lower`` holds such
    maps for host memory first, then the farther tiers (disk, outside the node).
    """
    host, *far_maps = lower
    run: dict[Worker, TieredMatch] = {}
    host_only: dict[int, int] = {}  # bit -> blocks of the run so far held in host memory, not on the device
    far_only: dict[int, int] = {}
    alive = -1
    depth = 0
    for block_hash in hashes:
        on_device = device.get(block_hash, 0)
        in_host = host.get(block_hash, 0)
        far = 0
        for tier in far_maps:
            far |= tier.get(block_hash, 0)
        here = (on_device | in_host | far) & alive
        if alive != -1 and (ended := alive & ~here):
            _end_runs(ended, depth, host_only, far_only, bits, run)
        if not here:
            return run
        alive = here
        depth += 1
        # Usually every worker in the run holds the block on its device: then there is nothing to count.
        if below := here & ~on_device:
            while below:
                low = below & -below
                if in_host & low:
                    host_only[low] = host_only.get(low, 0) + 1
                else:
                    far_only[low] = far_only.get(low, 0) + 1
                below ^= low
    if alive != -1:
        _end_runs(alive, depth, host_only, far_only, bits, run)
    return run


def _end_runs(
    mask: int, depth: int, host_only: dict[int, int], far_only: dict[int, int], bits: WorkerBits,
    run: dict[Worker, TieredMatch],
) -> None:  # fmt: skip
    """Record the runs of the workers in ``mask``, which end at ``depth`` blocks."""
    for worker in bits.workers(mask):
        bit = bits.bit(worker)
        host, far = host_only.get(bit, 0), far_only.get(bit, 0)
        run[worker] = TieredMatch(depth - host - far, host, far)


class KvIndexer:
    """The blocks each worker holds on each tier, as its KV events tell them."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # block hash -> mask of the workers holding it on the device
        self._bits = WorkerBits()
        self._blocks: dict[Worker, set[int]] = {}
        # The same, per tier below the device (host memory first); empty until an engine offloads.
        self._lower_holders: dict[Medium, dict[int, int]] = {tier: {} for tier in LOWER_TIERS}
        self._lower_blocks: dict[Medium, dict[Worker, set[int]]] = {tier: {} for tier in LOWER_TIERS}

    def find_matches(self, hashes: Sequence[int]) -> dict[Worker, int]:
        """{worker: number of leading blocks of ``hashes`` it holds on its device}, for workers holding one."""
        return leading_matches(self._holders, hashes, self._bits)

    def find_tiered(self, hashes: Sequence[int]) -> dict[Worker, TieredMatch]:
        """{worker: its leading run of ``hashes`` over every tier}, for workers holding the first block on one.

        With no worker caching below its device this is ``find_matches``, all on the device."""
        lower = [self._lower_holders[tier] for tier in LOWER_TIERS]
        if not any(lower):
            return {worker: TieredMatch(blocks) for worker, blocks in self.find_matches(hashes).items()}
        return leading_tiered_matches(self._holders, lower, hashes, self._bits)

    def apply(self, worker: Worker, events: Iterable[KvEvent]) -> None:
        """Apply ``worker``'s events in order; unknown blocks and repeated events change nothing."""
        for event in events:
            if isinstance(event, BlockStored):
                if event.medium in (None, "gpu"):
                    self._store(worker, event.block_hashes)
                else:
                    self._store_lower(event.medium, worker, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                if event.medium in (None, "gpu"):
                    self._remove(worker, event.block_hashes)
                else:
                    self._remove_lower(event.medium, worker, event.block_hashes)
            elif isinstance(event, AllCleared):
                self.clear_worker(worker)

    def replace(self, worker: Worker, events: Iterable[KvEvent]) -> None:
        """Make ``events`` (a worker's answer describing its whole cache) the worker's entire state."""
        self.clear_worker(worker)
        self.apply(worker, events)

    def clear_worker(self, worker: Worker) -> None:
        """Forget every block of ``worker``, on every tier."""
        blocks = self._blocks.pop(worker, None)
        if blocks is not None:
            self._unlink(self._holders, worker, blocks)
        for tier, by_worker in self._lower_blocks.items():
            if (lower := by_worker.pop(worker, None)) is not None:
                self._unlink(self._lower_holders[tier], worker, lower)

    def remove_instance(self, instance_id: int) -> None:
        """Forget every block of every dp rank of ``instance_id``."""
        for worker in [worker for worker in self._bits.known() if worker[0] == instance_id]:
            self.clear_worker(worker)
            self._bits.release(worker)

    def block_count(self, worker: Worker, tier: Medium | None = None) -> int:
        """Blocks ``worker`` holds on ``tier`` (None or "gpu": its device)."""
        if tier in (None, "gpu"):
            return len(self._blocks.get(worker, ()))
        return len(self._lower_blocks[tier].get(worker, ()))

    def workers(self) -> list[Worker]:
        """The workers holding at least one block on their device."""
        return [worker for worker, blocks in self._blocks.items() if blocks]

    def _store(self, worker: Worker, hashes: list[int]) -> None:
        blocks = self._blocks.setdefault(worker, set())
        holders = self._holders
        bit = self._bits.bit(worker)
        for block_hash in hashes:
            if block_hash in blocks:
                continue
            blocks.add(block_hash)
            holders[block_hash] = holders.get(block_hash, 0) | bit

    def _remove(self, worker: Worker, hashes: list[int]) -> None:
        blocks = self._blocks.get(worker)
        if blocks is None:
            return
        removed = [block_hash for block_hash in hashes if block_hash in blocks]
        blocks.difference_update(removed)
        self._unlink(self._holders, worker, removed)

    def _store_lower(self, tier: Medium, worker: Worker, hashes: list[int]) -> None:
        blocks = self._lower_blocks[tier].setdefault(worker, set())
        holders = self._lower_holders[tier]
        bit = self._bits.bit(worker)
        for block_hash in hashes:
            if block_hash not in blocks:
                blocks.add(block_hash)
                holders[block_hash] = holders.get(block_hash, 0) | bit

    def _remove_lower(self, tier: Medium, worker: Worker, hashes: list[int]) -> None:
        blocks = self._lower_blocks[tier].get(worker)
        if blocks is None:
            return
        removed = [block_hash for block_hash in hashes if block_hash in blocks]
        blocks.difference_update(removed)
        self._unlink(self._lower_holders[tier], worker, removed)

    def _unlink(self, holders: dict[int, int], worker: Worker, hashes: Iterable[int]) -> None:
        keep = ~self._bits.bit(worker)
        for block_hash in hashes:
            _drop_holder(holders, block_hash, keep)


class PredictedKvIndexer:
    """The blocks each worker is assumed to hold, from the requests routed to it lately.

    An entry lives ``ttl_s`` seconds from the last time a request with that block went to that
    worker; beyond ``max_blocks`` entries the least recently routed are dropped first.
    """

    def __init__(self, *, ttl_s: float, max_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or max_blocks < 1:
            raise ValueError(f"ttl_s must be > 0 and max_blocks >= 1, not {ttl_s} and {max_blocks}")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._clock = clock
        self._holders: dict[int, int] = {}  # block hash -> mask of the workers assumed to hold it
        self._bits = WorkerBits()
        # (block hash, worker) -> expiry, soonest first: every entry gets the same TTL when touched, so
        # moving a touched entry to the end keeps the order by expiry and by recency at once.
        self._expiry: OrderedDict[tuple[int, Worker], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._expiry)

    def find_matches(self, hashes: Sequence[int]) -> dict[Worker, int]:
        """{worker: number of leading blocks of ``hashes`` it is assumed to hold}."""
        self._expire(self._clock())
        return leading_matches(self._holders, hashes, self._bits)

    def record(self, worker: Worker, hashes: Sequence[int]) -> None:
        """A request with blocks ``hashes`` was routed to ``worker``: assume it holds them from now."""
        expires = self._clock() + self.ttl_s
        expiry, holders = self._expiry, self._holders
        bit = self._bits.bit(worker)
        for block_hash in hashes:
            key = (block_hash, worker)
            if key in expiry:
                expiry.move_to_end(key)
            else:
                holders[block_hash] = holders.get(block_hash, 0) | bit
            expiry[key] = expires
        while len(expiry) > self.max_blocks:
            self._drop(*expiry.popitem(last=False)[0])

    def remove_instance(self, instance_id: int) -> None:
        """Forget every block assumed of every dp rank of ``instance_id``."""
        for key in [key for key in self._expiry if key[1][0] == instance_id]:
            del self._expiry[key]
            self._drop(*key)
        for worker in [worker for worker in self._bits.known() if worker[0] == instance_id]:
            self._bits.release(worker)

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry:
            key = next(iter(expiry))
            if expiry[key] > now:
                return
            del expiry[key]
            self._drop(*key)

    def _drop(self, block_hash: int, worker: Worker) -> None:
        _drop_holder(self._holders, block_hash, ~self._bits.bit(worker))
