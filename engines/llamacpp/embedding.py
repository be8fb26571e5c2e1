"""Embedding token ids with llama.cpp, as ``Llama.embed`` embeds texts.

``Llama.embed`` takes texts only and tokenizes them itself; ``POST /v1/embeddings`` also takes token ids,
which must be embedded as given (as vLLM does: LangChain's ``OpenAIEmbeddings`` sends them by default).
``embed_token_ids`` is its loop without the tokenizing: sequences packed into batches of at most
``n_batch`` tokens and ``n_seq_max`` sequences, each decoded in one call and read back mean-pooled (the
embedding context is made with mean pooling) and normalized to unit length.
"""

from collections.abc import Sequence
from typing import Any

__all__ = ["embed_token_ids"]


def embed_token_ids(llama: Any, sequences: Sequence[list[int]]) -> tuple[list[list[float]], int]:
    """One unit-length vector per sequence of token ids, and how many tokens they were; ``llama`` is an
    embedding-mode, mean-pooled ``llama_cpp.Llama``. Raises ValueError for a sequence over ``n_batch``
    tokens (as ``Llama.embed`` does)."""
    import llama_cpp
    from llama_cpp import _internals

    n_batch: int = llama.n_batch
    n_seq_max: int = llama.context_params.n_seq_max
    n_embd: int = llama.n_embd()
    batch, ctx = llama._batch, llama._ctx
    vectors: list[list[float]] = []

    def decode(sequences_in_batch: int) -> None:
        ctx.kv_cache_clear()
        ctx.decode(batch)
        batch.reset()
        for seq_id in range(sequences_in_batch):
            pooled = llama_cpp.llama_get_embeddings_seq(ctx.ctx, seq_id)
            vectors.append(_internals.normalize_embedding(pooled[:n_embd]))  # type: ignore[no-untyped-call]

    batch.reset()
    pending = pending_tokens = total = 0
    try:
        for ids in sequences:
            if len(ids) > n_batch:
                raise ValueError(f"Requested tokens ({len(ids)}) exceed batch size of {n_batch}")
            if pending_tokens + len(ids) > n_batch or pending >= n_seq_max:
                decode(pending)
                pending = pending_tokens = 0
            # Every token marked as an output, as Llama.embed does (llama.cpp warns once per input otherwise).
            batch.add_sequence(ids, pending, True)
            pending += 1
            pending_tokens += len(ids)
            total += len(ids)
        if pending:
            decode(pending)
    finally:
        ctx.kv_cache_clear()
        llama.reset()
    return vectors, total
