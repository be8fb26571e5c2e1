"""Flotilla's SGLang engine (``flotilla run in=http out=sglang``) against SGLang's own OpenAI server.

Run from the repository root on a GPU node with ``flotilla[sglang]``:

    python bench/sglang_vs_server.py MODEL_DIR [--max-tokens 128] [--concurrency 1,8] [--requests 16] \\
        [--engine-args '{"attention_backend": "triton"}'] [--ignore-eos]

As bench/vllm_vs_server.py, with ``python -m sglang.launch_server`` as the baseline: SGLang's HTTP server, its
templating and detokenization, its scheduler in a process of its own. Both load MODEL_DIR with the same
``ServerArgs`` (``--engine-args``, given to SGLang's server as its flags and to Flotilla as
``--extra-engine-args``) and the same GPU memory share (SGLang's ``--mem-fraction-static``; Flotilla's
``--gpu-memory-utilization`` becomes it), one server at a time. Flotilla gives SGLang token ids in-process
(``skip_tokenizer_init``). Results also go to bench/results/sglang_vs_server.json.
"""

import sys

from _common import RESULTS_DIR, free_port
from vllm_vs_server import MODEL_NAME, compare, parse_args, server_flags

RESULTS_PATH = RESULTS_DIR / "sglang_vs_server.json"


def main() -> None:
    args, engine_args = parse_args(__doc__.splitlines()[0], "JSON ServerArgs fields for both servers")
    model = str(args.model.resolve())
    share = str(args.gpu_memory_utilization)
    baseline_command = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
        "--served-model-name", MODEL_NAME, "--mem-fraction-static", share,
        *server_flags(engine_args, false_flags=False),
    ]  # fmt: skip
    # SGLang's server also opens a gRPC port, its HTTP port + 10000 unless told: past 65535 for a high port.
    grpc = {"SGLANG_GRPC_PORT": str(free_port())}
    compare("sglang", baseline_command, args, engine_args, RESULTS_PATH, grpc)


if __name__ == "__main__":
    main()
