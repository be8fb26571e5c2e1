"""The host-memory KV tier of one simulated dp rank (KV offload, "G2"), as Dynamo 1.6.1's mocker simulates
vLLM's ``OffloadingConnector`` on its CPU path (``num_host_blocks``).

What it does, and when, follows the reference's resolved vLLM policy:

* **Copy out (device to host).** A prompt's full blocks are offered to the host once the step that computes
  them is scheduled, one cohort per sequence per step, only those not on the host already (prompt blocks
  only: generated tokens are not offloaded). A cohort reserves its host slots at once — evicting the least
  recently used host blocks that no copy is reading — or, when too few can be evicted, waits for a later step
  (``prepare`` says False and the scheduler retries). Reserved blocks are *pending*: not yet usable. The copy
  starts at the next step, once the computing pass is over, on one first-in-first-out device-to-host lane:
  it starts when the lane is free and lasts its bytes over the bandwidth, while the device computes on
  (asynchronous, as vLLM's copies run on their own stream). A block *lands* when its copy ends: usable from
  then on, announced as ``BlockStored(medium="cpu")``.
* **Lookup.** A waiting sequence looks at its device prefix first, then at the host for the blocks that
  follow it: the run of landed blocks there is brought back instead of computed. A block still pending in
  the run makes the sequence wait for a later step (the others are still admitted). Every block of the
  sequence found on the host is touched at each lookup, last first, so that its first blocks are the most
  recently used.
* **Bring back (host to device).** The sequence takes device blocks for its prefix and the run, and one copy
  of the run is queued on the host-to-device lane (first in, first out, its own bandwidth); the host blocks
  it reads cannot be evicted meanwhile, and stay on the host after. The sequence computes nothing until the
  copy ends: its first token waits for it (the H2D time is in its TTFT), and its prefill then computes only
  what neither tier held.
* **Eviction.** Least recently used first among landed blocks no copy is reading; ``BlockRemoved(medium="cpu")``.

Times are the rank's simulated clock in seconds, the scale of the step timer's (divided by ``speedup_ratio``).
Not simulated: the reference's source fence (a device block whose copy is still running is kept from reuse
until it ends; here the copy lands regardless), and a load's wait for copies out of the blocks it
overwrites.
"""

from collections import OrderedDict, deque
from collections.abc import Sequence

from engines.mocker.kv_cache_base import chains
from runtime.kv.events import BlockRemoved, BlockStored, KvEvent

#: A block to copy: its sequence hash and the hash of the block before it (None: the first).
Named = tuple[int, int | None]


class _Entry:
    """A host block: the name before it, whether its copy has landed, how many loads are reading it."""

    __slots__ = ("landed", "parent", "pins")

    def __init__(self, parent: int | None) -> None:
        self.parent = parent
        self.landed = False
        self.pins = 0


class _Copy:
    """One copy on a lane: its blocks and when it ends."""

    __slots__ = ("blocks", "ends", "ident")

    def __init__(self, ident: int, blocks: list[Named], ends: float) -> None:
        self.ident = ident
        self.blocks = blocks
        self.ends = ends


class _Lane:
    """A first-in-first-out copy lane: a copy starts when the one before it has ended."""

    __slots__ = ("block_seconds", "free_at")

    def __init__(self, block_seconds: float) -> None:
        self.block_seconds = block_seconds
        self.free_at = 0.0

    def submit(self, now: float, blocks: int) -> float:
        """When a copy of ``blocks`` blocks submitted at ``now`` ends."""
        self.free_at = max(now, self.free_at) + blocks * self.block_seconds
        return self.free_at


def block_seconds(block_bytes: int, gbps: float, speedup_ratio: float) -> float:
    """Simulated seconds to copy one block of ``block_bytes`` at ``gbps`` decimal GB/s (0 for a bandwidth or a
    speed-up of 0: no time, no waiting)."""
    if gbps <= 0 or speedup_ratio <= 0:
        return 0.0
    return block_bytes / (gbps * 1e9) / speedup_ratio


class HostTier:
    """Host KV blocks of one dp rank, keyed by sequence hash. Not thread-safe: one step loop owns it."""

    def __init__(self, num_blocks: int, *, d2h_block_seconds: float, h2d_block_seconds: float) -> None:
        """Raises ValueError for fewer than one block or a negative copy time."""
        if num_blocks < 1 or d2h_block_seconds < 0 or h2d_block_seconds < 0:
            raise ValueError(
                f"a host tier needs at least one block and copy times of 0 or more, not {num_blocks} blocks, "
                f"{d2h_block_seconds} s and {h2d_block_seconds} s a block"
            )
        self.num_blocks = num_blocks
        # Every host block, landed or pending, in the order reserved (cache_state keeps parents first).
        self._entries: dict[int, _Entry] = {}
        # Landed blocks no load reads, least recently used first: the eviction order.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._d2h = _Lane(d2h_block_seconds)
        self._h2d = _Lane(h2d_block_seconds)
        self._prepared: list[list[Named]] = []  # reserved cohorts, copied out at the next step
        self._stores: deque[_Copy] = deque()  # copies out under way, in the order they end
        self._loads: dict[int, _Copy] = {}  # copies back under way, by id
        self._next_id = 0
        #: Blocks landed on the host, and blocks brought back from it, since the start (load reports).
        self.offloaded_blocks = 0
        self.onboarded_blocks = 0
        self.record_events = False
        self._events: list[KvEvent] = []

    # -- what the scheduler asks -------------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        """Host blocks taken, landed or still being copied."""
        return len(self._entries)

    @property
    def landed_blocks(self) -> int:
        return sum(1 for entry in self._entries.values() if entry.landed)

    def holds(self, block_hash: int) -> bool:
        """Whether ``block_hash`` has landed on the host (a pending one is not yet usable)."""
        entry = self._entries.get(block_hash)
        return entry is not None and entry.landed

    @property
    def busy(self) -> bool:
        """Whether copies are reserved or under way: the step loop must run until they land."""
        return bool(self._prepared or self._stores or self._loads)

    def next_deadline(self) -> float | None:
        """When the next copy under way ends; None when none is."""
        ends = [copy.ends for copy in self._loads.values()]
        if self._stores:
            ends.append(self._stores[0].ends)
        return min(ends) if ends else None

    def lookup(self, hashes: Sequence[int], start: int, limit: int) -> tuple[int, bool]:
        """(how many of ``hashes[start:limit]`` have landed on the host one after the other from ``start``,
        whether the run stops at a block still being copied there: then wait and look again).

        Touches every landed block of ``hashes[start:limit]``, last first, as vLLM's connector does, so that a
        prompt's first blocks end the most recently used.
        """
        entries = self._entries
        run = 0
        pending = False
        for block_hash in hashes[start:limit]:
            entry = entries.get(block_hash)
            if entry is None or not entry.landed:
                pending = entry is not None
                break
            run += 1
        lru = self._lru
        for block_hash in reversed(hashes[start:limit]):
            if block_hash in lru:
                lru.move_to_end(block_hash)
        return run, pending

    # -- copies out --------------------------------------------------------------------------------

    def prepare(self, cohort: Sequence[Named]) -> bool:
        """Reserve host blocks for the blocks of ``cohort`` (one sequence's, in prefix order) not there yet, to
        be copied at the next ``submit``; evicts least recently used landed blocks as needed.

        Returns False, changing nothing, when too few can be evicted (the cohort is to be offered again at a
        later step); True otherwise. A cohort larger than the tier keeps its first blocks.
        """
        entries = self._entries
        seen: set[int] = set()
        fresh: list[Named] = []
        for block_hash, parent in cohort:
            if block_hash not in entries and block_hash not in seen:
                seen.add(block_hash)
                fresh.append((block_hash, parent))
        del fresh[self.num_blocks :]
        if not fresh:
            return True
        to_evict = len(fresh) - (self.num_blocks - len(entries))
        if to_evict > 0:
            protected = {block_hash for block_hash, _ in cohort}
            victims: list[int] = []
            for block_hash in self._lru:
                if block_hash not in protected:
                    victims.append(block_hash)
                    if len(victims) == to_evict:
                        break
            if len(victims) < to_evict:
                return False
            for block_hash in victims:
                del self._lru[block_hash]
                del entries[block_hash]
            if self.record_events:
                self._record_removed(victims)
        for block_hash, parent in fresh:
            entries[block_hash] = _Entry(parent)
        self._prepared.append(fresh)
        return True

    def submit(self, now: float) -> None:
        """Start the copies of the cohorts reserved since the last call, in order, on the device-to-host lane."""
        for cohort in self._prepared:
            self._stores.append(_Copy(self._new_id(), cohort, self._d2h.submit(now, len(cohort))))
        self._prepared.clear()

    # -- copies back -------------------------------------------------------------------------------

    def load(self, hashes: Sequence[int], now: float) -> tuple[int, float]:
        """Queue a copy of landed blocks ``hashes`` back to the device; they cannot be evicted until it ends.

        Returns (the copy's id, when it ends). Raises KeyError for a block that has not landed.
        """
        entries = self._entries
        blocks: list[Named] = []
        for block_hash in hashes:
            entry = entries[block_hash]
            if not entry.landed:
                raise KeyError(block_hash)
            blocks.append((block_hash, entry.parent))
        for block_hash, _ in blocks:
            entry = entries[block_hash]
            if entry.pins == 0:
                del self._lru[block_hash]
            entry.pins += 1
        ident = self._new_id()
        copy = _Copy(ident, blocks, self._h2d.submit(now, len(blocks)))
        self._loads[ident] = copy
        return ident, copy.ends

    def cancel_load(self, ident: int) -> None:
        """Drop copy ``ident`` (its sequence went away): its blocks can be evicted again. The lane stays as
        busy as it was, as the reference keeps it: the copies queued behind it keep their times."""
        copy = self._loads.pop(ident, None)
        if copy is not None:
            self._unpin(copy)

    # -- time --------------------------------------------------------------------------------------

    def tick(self, now: float) -> list[int]:
        """Apply the copies that have ended by ``now``: copied-out blocks land (and are announced), copied-back
        blocks can be evicted again. Returns the ids of the copies back that ended, in the order they ended."""
        ended: list[tuple[float, int, _Copy, bool]] = []
        stores = self._stores
        while stores and stores[0].ends <= now:
            copy = stores.popleft()
            ended.append((copy.ends, copy.ident, copy, True))
        for copy in self._loads.values():
            if copy.ends <= now:
                ended.append((copy.ends, copy.ident, copy, False))
        if not ended:
            return []
        ended.sort(key=lambda item: (item[0], item[1]))
        loaded: list[int] = []
        for _, ident, copy, is_store in ended:
            if is_store:
                self._land(copy)
            else:
                del self._loads[ident]
                self._unpin(copy)
                self.onboarded_blocks += len(copy.blocks)
                loaded.append(ident)
        return loaded

    def _land(self, copy: _Copy) -> None:
        entries, lru = self._entries, self._lru
        for block_hash, _ in copy.blocks:
            entries[block_hash].landed = True
            lru[block_hash] = None  # the most recently used
        self.offloaded_blocks += len(copy.blocks)
        if self.record_events:
            self._events.extend(chains(copy.blocks, medium="cpu"))

    def _unpin(self, copy: _Copy) -> None:
        entries = self._entries
        for block_hash, _ in copy.blocks:
            entry = entries[block_hash]
            entry.pins -= 1
            if entry.pins == 0:
                self._lru[block_hash] = None  # read just now: the most recently used

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # -- what routers learn ------------------------------------------------------------------------

    def cache_state(self) -> list[BlockStored]:
        """Every landed block as ``BlockStored(medium="cpu")`` chains, each block after its parent when the
        parent is on the host too (a parent evicted and copied again later is moved before its children)."""
        entries = self._entries
        ordered: list[Named] = []
        placed: set[int] = set()
        for block_hash, entry in entries.items():
            if not entry.landed or block_hash in placed:
                continue
            # Walk up to the first ancestor not yet placed, then place them from the top down.
            line = [block_hash]
            parent = entry.parent
            while parent is not None and parent not in placed:
                above = entries.get(parent)
                if above is None or not above.landed:
                    break
                line.append(parent)
                parent = above.parent
            for named in reversed(line):
                placed.add(named)
                ordered.append((named, entries[named].parent))
        return chains(ordered, medium="cpu")

    def take_events(self) -> list[KvEvent]:
        """The events recorded since the last call, in order."""
        events = self._events
        if events:
            self._events = []
        return events

    def _record_removed(self, hashes: list[int]) -> None:
        events = self._events
        if events and isinstance(last := events[-1], BlockRemoved) and last.medium == "cpu":
            last.block_hashes.extend(hashes)
        else:
            events.append(BlockRemoved(hashes, medium="cpu"))
