"""The machines one engine instance spans (``flotilla run --num-nodes N --node-rank R --leader-addr HOST:PORT``).

vLLM and SGLang can split one model over several machines (tensor or pipeline parallelism across nodes): the
same command runs on each, but for its rank. Rank 0, the leader, loads its share of the model and serves the
requests; the other ranks load theirs and run their share of every step, reached by the leader's
``torch.distributed`` group at ``--leader-addr`` (vLLM's ``master_addr:master_port``, SGLang's
``dist_init_addr``), and serve nothing themselves.

TensorRT-LLM spans nodes too, but under MPI: ``mpirun`` starts every rank and ``trtllm-llmapi-launch`` joins
them, so it takes none of these flags.
"""

from dataclasses import dataclass
from typing import NamedTuple

from runtime.errors import ConfigError

#: The engines that run one instance over several nodes through these flags.
MULTINODE_ENGINES = ("sglang", "vllm")


class LeaderAddress(NamedTuple):
    """Where the leader's (rank 0's) ``torch.distributed`` group is reached."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address keeps its brackets
        return f"{host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> "LeaderAddress":
        """``HOST:PORT`` (``[IPv6]:PORT`` for an IPv6 address). Raises ConfigError saying what is wrong."""
        host, sep, port_text = text.strip().rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        elif ":" in host:
            raise ConfigError(f"{text!r}: write an IPv6 leader address in brackets, [ADDRESS]:PORT")
        if not sep or not host or any(char.isspace() or char in "/[]" for char in host):
            raise ConfigError(f"{text!r} is not HOST:PORT (the leader's address and a free port, e.g. 10.0.0.1:29500)")
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ConfigError(f"{text!r}: the port {port_text!r} is not a TCP port (1-65535)")
        return cls(host, int(port_text))


@dataclass(frozen=True, kw_only=True)
class NodeGroup:
    """This node's place among those one engine instance spans: one node (the default) or rank ``node_rank``
    of ``num_nodes`` meeting at ``leader``."""

    num_nodes: int = 1
    node_rank: int = 0
    leader: LeaderAddress | None = None

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ConfigError(f"--num-nodes must be at least 1, not {self.num_nodes}")
        if not 0 <= self.node_rank < self.num_nodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is not a rank of --num-nodes {self.num_nodes}: "
                f"ranks count from 0 to {self.num_nodes - 1}"
            )
        if self.num_nodes > 1 and self.leader is None:
            raise ConfigError(
                f"--num-nodes {self.num_nodes} needs --leader-addr HOST:PORT: rank 0's machine and a free port on "
                "it, where the nodes meet"
            )

    @property
    def spans_nodes(self) -> bool:
        return self.num_nodes > 1

    @property
    def is_leader(self) -> bool:
        """Rank 0: it serves the requests."""
        return self.node_rank == 0

    def local_share(self, world_size: int) -> int:
        """The GPUs of ``world_size`` (tensor x pipeline parallel) that run on this node.

        Raises ConfigError when they do not split evenly over the nodes.
        """
        if world_size % self.num_nodes:
            raise ConfigError(
                f"{world_size} GPUs (--tensor-parallel-size times the pipeline stages) do not split evenly over "
                f"--num-nodes {self.num_nodes}: give a multiple of {self.num_nodes}"
            )
        return world_size // self.num_nodes
