"""``flotilla profile out=ENGINE [MODEL]``: measure a model's capacity on an engine, and write the planner's Profile.

The engine is built as ``flotilla run`` builds it (launcher/run.py), in this process, and driven directly
(launcher/profile_load.py). For each ISL the sweep doubles the concurrency of prompt-only requests and
keeps the most prompt tokens per second whose TTFT at the percentile meets ``--ttft-target``; for each
context length it does the same for decoding requests against ``--itl-target``. The result is a
planner/profile.py document, written to ``--output`` and, with ``--upload``, PUT to the control plane.
"""

import argparse
import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from engines.python_file import python_engine_file
from launcher import heap
from launcher.arg_types import checked_by, integer, number
from launcher.env_flags import EnvArgumentParser
from launcher.options import ENGINES, EXTRA_ARGS_ENGINES, RunOptions
from launcher.profile_sweep import Phase, Point, TimeScale, profile_document
from launcher.profile_upload import check_model_id, upload_profile
from launcher.run_parser import add_engine_flags, add_gpu_placement_flags, add_model_source_flags
from planner.errors import ProfileError
from runtime.config import env_str
from runtime.errors import ConfigError, FlotillaError
from runtime.fleet_contract.engine_names import GPU_ONLY_ENGINES
from runtime.logging import configure_logging

if TYPE_CHECKING:
    from frontend_gateway.models.pipeline import ServedModel
    from launcher.profile_load import Sweep
    from runtime.engine import Engine, TokenEngine

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130
#: The mocker's speed-up when --extra-engine-args sets none: a profile in seconds, not minutes, with the
#: measuring loop's own CPU time still small against a simulated step (docs/planner.md measured both).
MOCKER_SPEEDUP = 10.0
#: Engines that take text, not token ids: the sweep sends token ids of a set length, which they cannot take.
TEXT_ENGINES = ("echo_full", "mistralrs")

PROFILE_DESCRIPTION = """\
Measure a model's capacity on an engine and write the planner's profile (docs/planner.md).

The engine runs in this process, built as `flotilla run out=ENGINE MODEL` builds it. For each --isl,
requests of that many prompt tokens and one output token (distinct prompts: no prefix is reused) are
sent at concurrency 1, 2, 4, ... up to --max-concurrency; the profile keeps the most prompt tokens per
second whose TTFT at --percentile met --ttft-target. For each --context, requests decode at that mean
context, and the profile keeps the most output tokens per second whose ITL met --itl-target. A length's
sweep stops at its first point over target. Every point is printed as it is measured.

Token engines only (out=mocker, llamacpp, echo_core, vllm, sglang, trtllm, pytok:FILE.py). The mocker
runs at speed-up 10 unless --extra-engine-args sets "speedup_ratio"; its times and rates are scaled
back to its simulated time, so a profile says the same at any speed-up.
"""

PROFILE_EPILOG = """\
examples:
  flotilla profile out=mocker --ttft-target 0.5 --itl-target 0.05
  flotilla profile out=mocker --ttft-target 0.5 --itl-target 0.05 --isl 1024,4096 --context 2048 \\
      --extra-engine-args '{"speedup_ratio": 20, "num_gpu_blocks": 8192}' --output mocker.json
  flotilla profile out=vllm Qwen/Qwen3-0.6B --ttft-target 0.3 --itl-target 0.03 --max-concurrency 128 \\
      --upload http://10.0.0.1:8000 --model-id 12          # FLOTILLA_TOKEN holds an operator's token

exit codes:
  0    the profile was written (and uploaded, with --upload)
  1    no point met a target at some length (each is named, with the best measured), the engine failed,
       or the control plane could not be reached or failed (the profile file is written first)
  2    bad flags or variables, a model or engine that cannot be profiled, or an upload the control plane
       refused (a token, a model id)
  130  interrupted by Ctrl-C
"""


class ProfileShortfall(FlotillaError):
    """At some length no point met its target: no profile is written (each length is named)."""


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """``flotilla profile``'s settings once parsed."""

    run: RunOptions  # what builds the engine, as `flotilla run` would
    ttft_target_s: float
    itl_target_s: float
    isl: list[int]
    context: list[int]
    max_concurrency: int
    percentile: float
    output: Path
    upload_url: str | None = None
    token: str | None = None
    model_id: str | None = None


def _lengths(text: str) -> list[int]:
    """A comma-separated list of token counts, ascending, each once."""
    count = integer(1)
    words = [word.strip() for word in text.split(",")]
    if not any(words):
        raise argparse.ArgumentTypeError("give one or more token counts, comma-separated, e.g. 512,2048")
    values: list[int] = []
    for word in words:
        try:
            values.append(count(word))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(
                f"in {text!r}: {exc} (token counts are whole numbers, 1 or more)"
            ) from None
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"in {text!r}: a length is given twice")
    return sorted(values)


def _http_url(text: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL (e.g. http://10.0.0.1:8000)")
    return text.strip().rstrip("/")


_seconds = number(0.0, above_minimum=True, unit="seconds")


def build_profile_parser() -> EnvArgumentParser:
    """The parser of ``flotilla profile``. Every option but ``-v`` has an environment variable."""
    parser = EnvArgumentParser(
        prog="flotilla profile",
        description=PROFILE_DESCRIPTION,
        epilog=PROFILE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("args", nargs="*", metavar="out=ENGINE MODEL", help="the engine, and the model")
    parser.add_flag(
        "--ttft-target",
        env="FLOTILLA_PROFILE_TTFT_TARGET",
        type=_seconds,
        help="seconds: prefill points count only when their TTFT at --percentile is within it (required)",
    )
    parser.add_flag(
        "--itl-target",
        env="FLOTILLA_PROFILE_ITL_TARGET",
        type=_seconds,
        help="seconds: decode points count only when their ITL at --percentile is within it (required)",
    )
    parser.add_flag(
        "--isl",
        env="FLOTILLA_PROFILE_ISL",
        type=_lengths,
        default=[512, 2048, 8192],
        help="prompt lengths (tokens) to measure prefill at, comma-separated (default 512,2048,8192)",
    )
    parser.add_flag(
        "--context",
        env="FLOTILLA_PROFILE_CONTEXT",
        type=_lengths,
        default=[1024, 4096, 8192],
        help="context lengths (tokens, prompt and output so far) to measure decode at (default 1024,4096,8192)",
    )
    parser.add_flag(
        "--max-concurrency",
        env="FLOTILLA_PROFILE_MAX_CONCURRENCY",
        type=integer(1, 4096),
        default=64,
        help="the most requests at once; concurrency doubles from 1 up to it (default 64)",
    )
    parser.add_flag(
        "--percentile",
        env="FLOTILLA_PROFILE_PERCENTILE",
        type=number(0.0, 100.0, above_minimum=True),
        default=90.0,
        help="the TTFT and ITL percentile held to the targets, as the planner's (default 90)",
    )
    parser.add_flag(
        "--output",
        env="FLOTILLA_PROFILE_OUTPUT",
        type=Path,
        default=Path("profile.json"),
        help="where the profile is written (default profile.json)",
    )
    parser.add_flag(
        "--upload",
        env="FLOTILLA_PROFILE_UPLOAD",
        type=_http_url,
        help="the control plane's base URL: PUT the profile to URL/api/v1/models/MODEL_ID/profile/ "
        "(needs --model-id and --token)",
    )
    parser.add_flag(
        "--model-id",
        env="FLOTILLA_PROFILE_MODEL_ID",
        type=checked_by(check_model_id),
        help="with --upload: the catalog model the profile is for (its id, as the API and dashboard show it)",
    )
    parser.add_flag(
        "--token",
        env="FLOTILLA_TOKEN",
        help="with --upload: an operator's API token (or the file FLOTILLA_TOKEN_FILE names, which keeps it "
        "out of the process list)",
    )
    add_model_source_flags(parser)
    add_engine_flags(parser)
    add_gpu_placement_flags(parser)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v for debug logs, -vv for trace")
    return parser


def parse_profile_options(parser: EnvArgumentParser, namespace: argparse.Namespace) -> ProfileOptions:
    """Check the flags together; parser.error() (exit 2) on misuse. Raises ConfigError for a bad variable."""
    parser.check_environment()
    output, model = None, namespace.model_path
    for word in namespace.args:
        key, sep, value = word.partition("=")
        if sep and key == "out":
            output = value
        elif sep and key == "in":
            parser.error(f"{word}: flotilla profile sends its own load to the engine, in this process; drop in=")
        elif model is None:
            model = word
        else:
            parser.error(f"unexpected argument {word!r}: give out=ENGINE and one MODEL (or --model-path)")
    if output is None:
        parser.error("which engine? give out=ENGINE, e.g. out=mocker")
    _check_engine(parser, namespace, output)
    if namespace.ttft_target is None:
        parser.error(
            "--ttft-target (FLOTILLA_PROFILE_TTFT_TARGET) is required: the TTFT, in seconds, prefill must meet"
        )
    if namespace.itl_target is None:
        parser.error("--itl-target (FLOTILLA_PROFILE_ITL_TARGET) is required: the ITL, in seconds, decode must meet")
    if namespace.upload is not None:
        if namespace.model_id is None:
            parser.error("--upload needs --model-id (FLOTILLA_PROFILE_MODEL_ID): the catalog model it is for")
        if not (namespace.token or "").strip():
            parser.error("--upload needs --token (FLOTILLA_TOKEN or FLOTILLA_TOKEN_FILE): an operator's API token")
    run = RunOptions(
        output=output,
        model=model,
        model_name=namespace.model_name,
        model_config=namespace.model_config,
        context_length=namespace.context_length,
        threads=namespace.threads,
        parallel=namespace.parallel,
        extra_engine_args=namespace.extra_engine_args,
        tensor_parallel_size=namespace.tensor_parallel_size or 1,
        base_gpu_id=namespace.base_gpu_id,
        gpu_memory_utilization=namespace.gpu_memory_utilization,
    )
    return ProfileOptions(
        run=run,
        ttft_target_s=namespace.ttft_target,
        itl_target_s=namespace.itl_target,
        isl=namespace.isl,
        context=namespace.context,
        max_concurrency=namespace.max_concurrency,
        percentile=namespace.percentile,
        output=namespace.output,
        upload_url=namespace.upload,
        token=(namespace.token or "").strip() or None,
        model_id=namespace.model_id,
    )


def _check_engine(parser: EnvArgumentParser, namespace: argparse.Namespace, output: str) -> None:
    """Refuse an engine the sweep cannot drive, and flags that do not configure it (parser.error)."""
    python_engine = python_engine_file(output)
    if python_engine is not None:
        kind, file = python_engine
        if kind == "pystr":
            parser.error(f"out={output}: a pystr engine takes text; profile a token engine (out=pytok:FILE.py)")
        if not file:
            parser.error(f"out={output!r} needs a file: out={kind}:FILE.py")
    elif output in TEXT_ENGINES:
        parser.error(
            f"out={output} takes text, not token ids, so prompts of a set length cannot be sent to it; profile a "
            "token engine: out=mocker, llamacpp, echo_core, vllm, sglang, trtllm or pytok:FILE.py"
        )
    elif output not in ENGINES or output == "dyn":
        engines = ", ".join(engine for engine in ENGINES if engine not in (*TEXT_ENGINES, "dyn"))
        parser.error(
            f"out={output!r} is not an engine flotilla profile can measure; use one of {engines}, pytok:FILE.py"
        )
    for flag, value in (
        ("--tensor-parallel-size", namespace.tensor_parallel_size),
        ("--base-gpu-id", namespace.base_gpu_id),
        ("--gpu-memory-utilization", namespace.gpu_memory_utilization),
    ):
        if value is not None and output not in GPU_ONLY_ENGINES:
            parser.error(f"{flag} places a GPU engine (out=vllm, sglang, trtllm) on its GPUs, not out={output}")
    if namespace.extra_engine_args is not None and output not in EXTRA_ARGS_ENGINES:
        engines = " or ".join(f"out={engine}" for engine in EXTRA_ARGS_ENGINES)
        parser.error(f"--extra-engine-args (FLOTILLA_EXTRA_ENGINE_ARGS) configures {engines}, not out={output}")


def build_engine(run: RunOptions) -> tuple["ServedModel", "Engine", TimeScale]:
    """The model and its engine, as ``flotilla run`` builds them, and how the engine's time runs.

    The mocker runs at MOCKER_SPEEDUP unless its settings name a speed-up. Raises ConfigError (a bad
    setting, a speed-up of 0, a missing model), ModelError.
    """
    from launcher.run import build_mocker_model, build_model

    if run.output != "mocker":
        model, engine = build_model(run)
        return model, engine, TimeScale()
    import msgspec

    from engines.mocker.config import load_mocker_config
    from engines.shared.extra_engine_args import read_engine_args

    config = load_mocker_config(run.extra_engine_args)
    if "speedup_ratio" not in read_engine_args(run.extra_engine_args, engine="mocker", syntax="json"):
        config = msgspec.structs.replace(config, speedup_ratio=MOCKER_SPEEDUP)
    if config.speedup_ratio == 0:
        raise ConfigError(
            '--extra-engine-args: "speedup_ratio": 0 makes the mocker take no time, so there is nothing to measure; '
            f"give 1 or more (default here {MOCKER_SPEEDUP:g})"
        )
    model, engine = build_mocker_model(run, config=config)
    return model, engine, TimeScale(config.speedup_ratio)


def _check_lengths(options: ProfileOptions, model: "ServedModel") -> None:
    """Refuse lengths the model cannot hold (ConfigError). The mocker is not held to its tokenizer's model:
    it simulates an engine whose context is its KV cache."""
    limit = model.context_length
    if options.run.output == "mocker" or not limit:
        return
    for flag, longest in (("--isl", options.isl[-1] + 1), ("--context", options.context[-1])):
        if longest > limit:
            raise ConfigError(
                f"{flag}: {longest} tokens (with its output) do not fit in the model's context of {limit} tokens"
            )


class Table:
    """The points as they are measured, one line each, flushed at once: long sweeps show their progress."""

    def __init__(self, stream: TextIO, percent: float) -> None:
        self._stream = stream
        self._percent = percent
        self._started = time.perf_counter()

    def say(self, text: str) -> None:
        print(text, file=self._stream, flush=True)

    def header(self) -> None:
        self.say(
            f"{'phase':<8}{'length':>8}{'conc':>6}{'reqs':>6}  {'p' + format(self._percent, 'g') + ' latency':>16}"
            f"{'tokens/s':>12}  target    elapsed"
        )

    def row(self, point: Point, met: bool) -> None:
        what = "TTFT" if point.phase == "prefill" else "ITL"
        latency = f"{what} {point.latency_s * 1000:,.1f} ms"
        self.say(
            f"{point.phase:<8}{point.length:>8}{point.concurrency:>6}{point.requests:>6}  {latency:>16}"
            f"{point.tokens_per_s:>12,.0f}  {'met' if met else 'over':<6}{time.perf_counter() - self._started:>9.1f} s"
        )


async def measure(
    options: ProfileOptions, engine: "TokenEngine", vocab_size: int, scale: TimeScale, table: Table
) -> "Sweep":
    """Run both sweeps on the started ``engine``. Raises what the engine raises (EngineError)."""
    from launcher.profile_load import Prompts, Sweep, sweep_lengths, warm_up

    prompts = Prompts(vocab_size)
    await warm_up(engine, prompts, options.isl[0])
    sweep = Sweep()
    phases: tuple[tuple[Phase, list[int], float], ...] = (
        ("prefill", options.isl, options.ttft_target_s),
        ("decode", options.context, options.itl_target_s),
    )
    for phase, lengths, target_s in phases:
        what = "TTFT" if phase == "prefill" else "ITL"
        table.say(
            f"\n{phase}: {', '.join(map(str, lengths))} tokens, concurrency doubling from 1 to "
            f"{options.max_concurrency} until {what} p{options.percentile:g} is over {target_s:g} s"
        )
        table.header()
        measured = await sweep_lengths(
            engine,
            prompts,
            phase,
            lengths,
            max_concurrency=options.max_concurrency,
            target_s=target_s,
            percent=options.percentile,
            scale=scale,
            report=table.row,
        )
        if phase == "prefill":
            sweep.prefill = measured
        else:
            sweep.decode = measured
    return sweep


async def _profile(options: ProfileOptions, table: Table) -> dict[str, object]:
    """Build and start the engine, sweep, and return the profile document. Raises FlotillaError (a
    ConfigError for what cannot be profiled, a ProfileShortfall when a target was met nowhere)."""
    from frontend_gateway.models.pipeline import TokenModel

    model, engine, scale = build_engine(options.run)
    if not isinstance(model, TokenModel) or engine.kind != "token":
        raise ConfigError(f"out={options.run.output} takes text, not token ids: profile a token engine")
    _check_lengths(options, model)
    token_engine: TokenEngine = model.engine
    timed = "" if scale.speedup == 1 else f" at speed-up {scale.speedup:g} (times and rates below are at speed-up 1)"
    table.say(f"profiling {model.name} on out={options.run.output}{timed}")
    await engine.start()
    heap.settle()  # as `flotilla run` does: a full collection's pause would count in the points measured
    try:
        sweep = await measure(options, token_engine, model.card.tokenizer.get_vocab_size(), scale, table)
    finally:
        await engine.close()
    if missed := sweep.shortfalls(options.ttft_target_s, options.itl_target_s):
        raise ProfileShortfall("\n".join(str(one) for one in missed))
    speed = "" if scale.speedup == 1 else f", run at speed-up {scale.speedup:g} and scaled to 1"
    notes = (
        f"measured by flotilla profile on {datetime.now(UTC):%Y-%m-%d}: TTFT and ITL at p{options.percentile:g}, "
        f"concurrency up to {options.max_concurrency}{speed}"
    )
    return profile_document(
        sweep.chosen("prefill", options.ttft_target_s),
        sweep.chosen("decode", options.itl_target_s),
        ttft_target_s=options.ttft_target_s,
        itl_target_s=options.itl_target_s,
        gpus_per_replica=options.run.tensor_parallel_size,
        model=model.name,
        engine=options.run.output,
        notes=notes,
    )


def profile_main(args: list[str]) -> int:
    """``flotilla profile ARGS``; returns the exit code (see PROFILE_EPILOG)."""
    parser = build_profile_parser()
    namespace = parser.parse_intermixed_args(args)
    try:
        configure_logging(env_str("FLOTILLA_LOG"), namespace.verbose)
        options = parse_profile_options(parser, namespace)
        import uvloop

        table = Table(sys.stdout, options.percentile)
        document = uvloop.run(_profile(options, table))
        _write(options.output, document)
        table.say(f"\nwrote {options.output}: {_summary(document)}")
        if options.upload_url is not None and options.model_id is not None and options.token is not None:
            status = upload_profile(options.upload_url, options.model_id, options.token, document)
            table.say(f"uploaded to {options.upload_url} as model {options.model_id}'s profile ({status})")
        return EXIT_OK
    except ProfileShortfall as exc:
        print(f"flotilla profile: no profile written:\n{exc}", file=sys.stderr)
        return EXIT_FAILED
    except ProfileError as exc:  # a measurement the planner would refuse (a rate of 0): a bug, said plainly
        print(f"flotilla profile: the measured profile is not valid: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ConfigError as exc:
        print(f"flotilla profile: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except FlotillaError as exc:  # the engine failed, or UploadFailed
        print(f"flotilla profile: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _write(path: Path, document: dict[str, object]) -> None:
    """Write the profile; raises ConfigError when ``path`` cannot be written (a folder to fix)."""
    try:
        path.write_text(json.dumps(document, indent=2) + "\n")
    except OSError as exc:
        raise ConfigError(f"--output {path}: cannot be written: {exc.strerror or exc}") from exc


def _summary(document: dict[str, object]) -> str:
    parts = []
    for phase, length in (("prefill", "isl"), ("decode", "context_tokens")):
        section = document[phase]
        assert isinstance(section, dict)
        points = ", ".join(f"{p[length]}: {p['tokens_per_s']:,.0f}" for p in section["points"])
        parts.append(f"{phase} tokens/s {points}")
    return "; ".join(parts)
