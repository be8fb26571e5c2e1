"""A worker's start: from ``flotilla run in=dyn://… out=mocker`` to its banner (engine up, instance and model
registered in etcd, tokenizer in the object store), against real etcd and NATS on this machine.

    .venv/bin/python bench/worker_start.py [--rounds 9] [--baseline REV]

With ``--baseline REV`` the same start is timed at git revision REV too (checked out in a temporary
worktree, run with this interpreter), the two alternating round by round, and the ratio of the medians is
printed (below 1: this tree starts faster). A fleet's scale-up waits for its workers' starts: see
bench/fleet_scale.py for the whole path through the control plane and the agents.
"""

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from tests.infra import EtcdServer, NatsServer  # noqa: E402
from tests.servers import smollm2_path  # noqa: E402


def start_once(tree: Path, env: dict[str, str], namespace: str) -> float:
    """Seconds from the worker's process start to its banner; the worker is stopped after."""
    command = [sys.executable, "-m", "launcher.cli", "run", f"in=dyn://{namespace}.backend.generate", "out=mocker"]
    began = time.perf_counter()
    worker = subprocess.Popen(
        [*command, str(smollm2_path())],
        cwd=tree,
        env={**env, "PYTHONPATH": str(tree)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert worker.stdout is not None
    try:
        for line in worker.stdout:
            if line.startswith("Flotilla worker ") and " serves " in line:
                return time.perf_counter() - began
        raise SystemExit(f"the worker of {tree} ended before its banner:\n{worker.communicate()[1][-3000:]}")
    finally:
        worker.terminate()
        worker.communicate(timeout=30)


@contextlib.contextmanager
def worktree(revision: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="flotilla-baseline-") as folder:
        path = Path(folder) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(path), revision], cwd=REPOSITORY, check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPOSITORY, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="starts per tree (default 9)")
    parser.add_argument("--baseline", metavar="REV", help="a git revision to time the same way, alternating")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        etcd = EtcdServer(Path(folder) / "etcd")
        etcd.start()
        stack.callback(etcd.stop)
        nats = NatsServer(Path(folder) / "nats")
        nats.start()
        stack.callback(nats.stop)
        env = {**os.environ, "ETCD_ENDPOINTS": etcd.endpoint, "NATS_SERVER": nats.url}
        trees = {"current tree": REPOSITORY}
        if args.baseline:
            trees[f"baseline {args.baseline}"] = stack.enter_context(worktree(args.baseline))
        times: dict[str, list[float]] = {name: [] for name in trees}
        for round_number in range(args.rounds):
            for index, (name, tree) in enumerate(trees.items()):
                times[name].append(start_once(tree, env, f"w{round_number}x{index}"))
        for name, values in times.items():
            print(
                f"{name}: worker start to banner, median {statistics.median(values):.3f} s "
                f"(min {min(values):.3f}, max {max(values):.3f}, {len(values)} starts)"
            )
        if args.baseline:
            ratio = statistics.median(times["current tree"]) / statistics.median(times[f"baseline {args.baseline}"])
            print(f"current / baseline: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
