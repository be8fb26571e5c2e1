"""How an ingress's counts reach Redis exactly once: one Lua script per flush applies a batch of counts and
reads the fleet's totals back, atomically.

A flush whose reply is lost (a timeout, a reset connection, redis-py retrying on a new connection) may
have been applied or not; the ingress cannot tell. So each batch carries a sequence number, and Redis keeps
the last one applied per ingress process (``flotilla:flush:<meter id>``): the batch is sent again, as it
was, until a reply comes, and the script applies it only if its number is past the one kept. New counts
wait for the next batch meanwhile, so at most one batch is in doubt at a time.

Redis runs the script as one command: nothing else sees a batch half applied. (The keys are named in
ARGV, so this needs a single Redis, not a cluster, as the rest of the fleet does.)
"""

from dataclasses import dataclass, field

FLUSH_PREFIX = "flotilla:flush:"  # + a meter's id: the sequence number of the last batch Redis applied
#: How long Redis keeps a meter's last sequence number: far past any retry of a batch in doubt.
MARKER_TTL_S = 86400

#: ARGV: the marker's key, its TTL, the batch's sequence number (0: no batch), its operation count, the
#: operations (kind, key, TTL or hash field, delta: "i" INCRBY and EXPIRE, "h" HINCRBY), then the keys to
#: read. Returns each key's value ("0" when absent), read after the batch applied.
SCRIPT = """
local marker, seq, count = ARGV[1], tonumber(ARGV[3]), tonumber(ARGV[4])
local at = 5
if seq > tonumber(redis.call('GET', marker) or '0') then
  for _ = 1, count do
    local kind, key, extra, delta = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3]
    if kind == 'h' then
      redis.call('HINCRBY', key, extra, delta)
    else
      redis.call('INCRBY', key, delta)
      redis.call('EXPIRE', key, extra)
    end
    at = at + 4
  end
  redis.call('SET', marker, seq, 'EX', ARGV[2])
else
  at = at + 4 * count
end
local totals = {}
for index = at, #ARGV do
  totals[#totals + 1] = redis.call('GET', ARGV[index]) or '0'
end
return totals
"""


@dataclass
class Operations:
    """A batch's operations, flattened as the script takes them."""

    args: list[str | int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.args) // 4

    def add(self, name: str, delta: int, ttl_s: int) -> None:
        """INCRBY ``name`` by ``delta``, and expire it after ``ttl_s``."""
        self.args += ("i", name, ttl_s, delta)

    def add_to_hash(self, name: str, hash_field: str, delta: int) -> None:
        """HINCRBY ``name``'s ``hash_field`` by ``delta``."""
        self.args += ("h", name, hash_field, delta)


def script_args(marker: str, seq: int, operations: Operations | None, reads: list[str]) -> list[str | int]:
    """The script's ARGV for batch ``seq`` (None, 0: only read) under ``marker``, then ``reads``."""
    if operations is None:
        return [marker, MARKER_TTL_S, 0, 0, *reads]
    return [marker, MARKER_TTL_S, seq, len(operations), *operations.args, *reads]
