"""The worker API: a user's Python worker (examples/worker_api.py) served through the ingress."""

import subprocess
import sys
from pathlib import Path

import openai

from tests.distributed.cluster import Cluster, Worker, served_models, wait_until

EXAMPLE = Path(__file__).parents[2] / "examples" / "worker_api.py"


def start_example_worker(cluster: Cluster) -> Worker:
    log_path = cluster.directory / "worker_api.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, str(EXAMPLE)], stdout=log_file, stderr=subprocess.STDOUT, env=cluster.env()
        )
    worker = Worker(process, log_path)
    cluster.workers.append(worker)  # stopped with the cluster
    return worker


def test_the_worker_api_example_is_served_through_the_ingress(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    worker = start_example_worker(cluster)

    def registered() -> bool:
        assert worker.process.poll() is None, f"the worker exited:\n{worker.log()}"
        return served_models(ingress) == ["shout"]

    wait_until(registered, 15, "the worker's model did not appear")
    client = openai.OpenAI(base_url=ingress.api_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="shout", messages=[{"role": "user", "content": "hello from python"}])
    assert reply.choices[0].message.content == "HELLO FROM PYTHON"
    assert reply.choices[0].finish_reason == "stop"

    stream = client.completions.create(model="shout", prompt="one two three four", max_tokens=2, stream=True)
    chunks = [chunk for chunk in stream if chunk.choices]
    assert "".join(chunk.choices[0].text for chunk in chunks) == "ONE TWO"
    assert chunks[-1].choices[0].finish_reason == "length"

    worker.stop()
    assert worker.process.returncode == 0, worker.log()
    wait_until(lambda: served_models(ingress) == [], 10, "the stopped worker's model was not removed")
