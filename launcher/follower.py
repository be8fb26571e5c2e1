"""``flotilla run out=vllm|sglang --num-nodes N --node-rank R`` with R above 0: this node's share of an engine
instance whose leader (rank 0) serves.

Such a rank takes no requests: it registers no endpoint, opens no HTTP port and reads no input, so ``in=`` is
ignored (every node runs the same command but for ``--node-rank``), but for one use: with SGLang's attention DP
across nodes, this node's dp ranks' KV events are relayed to the leader's worker on the NATS subjects of the
pipeline ``in=dyn://...`` names (engines/sglang/dp_relay.py, in a thread with its own event loop).

It starts the engine's processes for this node, which join the leader's ``torch.distributed`` group at
``--leader-addr``, and watches them: it exits 1 when one of them dies (the leader's instance cannot go on without
them, and a supervisor restarting the node is the way back) or when the leader stops answering at
``--leader-addr`` for about 10 s (launcher/leader_watch.py: the engine's processes would wait for it for ever),
0 on SIGTERM, 130 on Ctrl-C.

It runs without an event loop, in the main thread, as vLLM's own ``run_headless`` does: a signal interrupts
whatever the start is waiting for (the leader may not be up yet).
"""

import importlib.util
import logging
import os
import signal
import threading
import types
from pathlib import Path
from typing import Protocol

from launcher.leader_watch import LeaderWatch
from launcher.options import RunOptions
from runtime.errors import ConfigError

log = logging.getLogger(__name__)


class Follower(Protocol):
    """The engine's processes of one rank above 0."""

    def start(self) -> None: ...

    def wait(self) -> str: ...

    def close(self) -> None: ...


class _Stopped(BaseException):
    """A stop signal, raised in the main thread wherever the run waits."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _LeaderGone(BaseException):
    """The leader stopped answering (LeaderWatch), raised in the main thread wherever the run waits."""


#: What the leader watch sends the main thread when the leader is gone.
LEADER_GONE_SIGNAL = signal.SIGUSR1


def build_follower(options: RunOptions) -> Follower:
    """This rank's processes for ``options.output`` (vllm or sglang), not yet started; the settings are checked
    first (ConfigError), the model resolved (downloaded if needed) after."""
    from runtime.models.source import resolve_model

    nodes = options.node_group
    if options.output == "vllm":
        from engines.vllm.follower import VllmFollower
        from engines.vllm.settings import (
            MISSING_PACKAGE,
            VllmSettings,
            check_extra_args,
            engine_arg_names,
            read_extra_args,
        )

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(MISSING_PACKAGE)
        extra = read_extra_args(options.extra_engine_args)
        check_extra_args(extra, engine_arg_names())
        # The GPUs must split evenly over the nodes: said now, before a download.
        nodes.local_share(options.tensor_parallel_size * int(extra.get("pipeline_parallel_size", 1)))
        settings = VllmSettings(
            model=str(_folder(resolve_model(options.model), "vllm")),
            max_model_len=options.context_length,
            tensor_parallel_size=options.tensor_parallel_size,
            gpu_memory_utilization=options.gpu_memory_utilization,
            nodes=nodes,
            extra=extra,
        )
        return VllmFollower(settings, base_gpu_id=options.base_gpu_id)
    if options.output == "sglang":
        from engines.sglang.engine import MISSING_PACKAGE as SGLANG_MISSING
        from engines.sglang.engine import parse_engine_args
        from engines.sglang.follower import SglangFollower
        from engines.shared.gpu_engine_args import GpuPlacement
        from runtime.cluster.addressing import EndpointAddress
        from runtime.settings import nats_servers

        if importlib.util.find_spec("sglang") is None:
            raise ConfigError(SGLANG_MISSING)
        engine_args = parse_engine_args(options.extra_engine_args)
        placement = GpuPlacement(
            tensor_parallel_size=options.tensor_parallel_size,
            base_gpu_id=options.base_gpu_id or 0,
            context_length=options.context_length,
            gpu_memory_fraction=options.gpu_memory_utilization,
        )
        nodes.local_share(options.tensor_parallel_size * int(engine_args.get("pp_size", 1)))
        # Its dp ranks' KV events (attention DP across nodes) are relayed on the pipeline the leader serves.
        relay_to = EndpointAddress.parse(options.worker_address) if options.worker_address is not None else None
        servers = nats_servers() if relay_to is not None else None
        path = _folder(resolve_model(options.model), "sglang")
        return SglangFollower(path, placement, engine_args, nodes, relay_to=relay_to, nats_servers=servers)
    raise ConfigError(f"out={options.output} does not span nodes: --node-rank is for out=vllm and out=sglang")


def _folder(path: Path, engine: str) -> Path:
    if not path.is_dir():
        raise ConfigError(f"out={engine} loads a Hugging Face folder (safetensors); {str(path)!r} is not one")
    return path


def run_follower(options: RunOptions) -> int:
    """Run rank ``options.node_rank`` until its processes die (1) or a signal stops it (0, or 130 for SIGINT).

    Raises ConfigError or ModelError (exit 2) for bad settings or a model it cannot start.
    """
    follower = build_follower(options)
    nodes = options.node_group
    log.info(
        "out=%s: serving as rank %d of %d for the leader at %s; this node takes no requests (rank 0 serves them)%s",
        options.output,
        nodes.node_rank,
        nodes.num_nodes,
        nodes.leader,
        # An SGLang rank relays its dp ranks' KV events on the pipeline in=dyn://... names: that is not ignored.
        ""
        if options.input == "text" or (options.output == "sglang" and options.worker_address)
        else f", so in={options.input} is ignored here",
    )
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, LEADER_GONE_SIGNAL)}
    why_gone: list[str] = []
    main_thread = threading.get_ident()  # run_follower runs in the main thread (signals are handled there)

    this_process = os.getpid()

    def stop(signum: int, frame: types.FrameType | None) -> None:
        if os.getpid() != this_process:
            # A process the engine forked inherits this handler: there it must do what the signal does by
            # default (end the process), or SIGTERM from the engine's own shutdown would be swallowed and the
            # engine would wait for that process for ever.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if signum == LEADER_GONE_SIGNAL:
            raise _LeaderGone
        raise _Stopped(signum)

    def leader_gone(why: str) -> None:  # in the watch's thread
        why_gone.append(why)
        signal.pthread_kill(main_thread, LEADER_GONE_SIGNAL)

    assert nodes.leader is not None  # a rank above 0 has a leader (NodeGroup checks)
    watch = LeaderWatch(nodes.leader, leader_gone)
    for signum in previous:
        signal.signal(signum, stop)
    try:
        follower.start()
        log.info("rank %d of %d: the engine's processes are up, joined to the leader", nodes.node_rank, nodes.num_nodes)
        watch.start()
        ended = follower.wait()
        log.error(
            "rank %d of %d stops: %s; the leader's engine cannot run without this node's share of it",
            nodes.node_rank,
            nodes.num_nodes,
            ended,
        )
        return 1
    except _LeaderGone:
        log.error(
            "rank %d of %d stops: %s; its engine's processes would wait for the leader for ever",
            nodes.node_rank, nodes.num_nodes, why_gone[0] if why_gone else "the leader is gone",
        )  # fmt: skip
        return 1
    except _Stopped as stopped:
        log.info("rank %d of %d stopped by %s", nodes.node_rank, nodes.num_nodes, signal.Signals(stopped.signum).name)
        return 130 if stopped.signum == signal.SIGINT else 0
    finally:
        for signum in previous:
            signal.signal(signum, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        watch.stop()
        try:
            follower.close()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
