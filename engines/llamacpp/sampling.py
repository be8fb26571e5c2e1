"""One request's sampling on llama.cpp: its own sampler chain, log probabilities, JSON-schema grammars.

Each sequence of the batch gets its own chain (penalty window, grammar state, random generator), so
requests decoded together sample exactly as they would alone.
"""

import functools
import importlib
from collections.abc import Callable
from typing import Any

from runtime.errors import RequestRejected
from runtime.protocol import PreprocessedRequest, SamplingOptions, TokenLogprob

# llama.cpp's own defaults (those of llama_cpp.server), used where the request leaves a field unset.
_DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1}
#: How many of the last tokens the repeat/frequency/presence penalties look at (llama-cpp-python's default).
PENALTY_WINDOW = 64


def sampling_kwargs(sampling: SamplingOptions) -> dict[str, Any]:
    """The request's sampling settings, llama.cpp's defaults where it leaves one unset."""

    def pick(value: float | int | None, default: float | int) -> float | int:
        return default if value is None else value

    top_k = sampling.top_k
    return {
        "temp": pick(sampling.temperature, _DEFAULTS["temperature"]),
        "top_p": pick(sampling.top_p, _DEFAULTS["top_p"]),
        # OpenAI-style -1 (and 0) mean "no top-k"; llama.cpp spells that 0.
        "top_k": _DEFAULTS["top_k"] if top_k is None else max(top_k, 0),
        "min_p": pick(sampling.min_p, _DEFAULTS["min_p"]),
        "repeat_penalty": pick(sampling.repetition_penalty, _DEFAULTS["repeat_penalty"]),
        "frequency_penalty": pick(sampling.frequency_penalty, 0.0),
        "presence_penalty": pick(sampling.presence_penalty, 0.0),
    }


class SequenceSampler:
    """llama-cpp-python 0.3's sampler chain for one request: (EOS held back until min_tokens), (logit_bias),
    penalties, the grammar, then greedy or top-k/typical/top-p/min-p/temperature + a seeded draw.

    The chain is the one ``Llama._init_sampler`` builds, with the request's own seed (``Llama`` keeps
    one seed for all requests). The migrated tokens of a request enter its penalty window. Call
    ``close()`` when the request ends.
    """

    def __init__(self, model: Any, request: PreprocessedRequest, grammar: Any) -> None:
        import llama_cpp

        # Typed loosely: llama-cpp-python's wrappers have no annotations.
        _internals: Any = importlib.import_module("llama_cpp._internals")

        settings = sampling_kwargs(request.sampling)
        self.greedy = settings["temp"] == 0
        self.generated = 0
        self._chain = _internals.LlamaSampler()
        stop = request.stop_conditions
        if stop.min_tokens > 0 and not stop.ignore_eos:
            eos_ids = sorted({*request.eos_token_ids, model.token_eos()})
            self._chain.add_custom(self._hold_back(eos_ids, stop.min_tokens))
        if request.sampling.logit_bias:
            self._chain.add_custom(_biased(request.sampling.logit_bias))
        n_vocab = model.n_vocab()
        self._chain.add_penalties(
            n_vocab=n_vocab,
            penalty_last_n=PENALTY_WINDOW,
            penalty_repeat=settings["repeat_penalty"],
            penalty_freq=settings["frequency_penalty"],
            penalty_present=settings["presence_penalty"],
        )
        # The grammar (structured output) masks every token that would break the JSON schema; once the
        # JSON is complete it allows only end-of-generation tokens, so the answer ends there.
        if grammar is not None:
            self._chain.add_grammar(model, grammar)
        seed = llama_cpp.LLAMA_DEFAULT_SEED if request.sampling.seed is None else request.sampling.seed
        if self.greedy:
            self._chain.add_greedy()
        else:
            self._chain.add_top_k(settings["top_k"])
            self._chain.add_typical(1.0, 1)
            self._chain.add_top_p(settings["top_p"], 1)
            self._chain.add_min_p(settings["min_p"], 1)
            self._chain.add_temp(settings["temp"])
            self._chain.add_dist(seed)
        migrated = request.token_ids[len(request.token_ids) - request.migrated_tokens :]
        for token in migrated:
            self._chain.accept(token)

    def _hold_back(self, token_ids: list[int], min_tokens: int) -> Callable[[Any], None]:
        """A chain step that forbids ``token_ids`` (EOS) until ``min_tokens`` tokens are generated.

        It runs first in the chain, where the candidates are still the whole vocabulary in id order.
        """

        def apply(candidates: Any) -> None:
            if self.generated < min_tokens:
                data = candidates.contents.data
                for token in token_ids:
                    data[token].logit = float("-inf")

        return apply

    def sample(self, ctx: Any, row: int) -> int:
        """The next token from the logits of batch row ``row`` (accepted into the penalty window)."""
        token = int(self._chain.sample(ctx, row))
        self.generated += 1
        return token

    def close(self) -> None:
        self._chain.close()


def _biased(biases: dict[int, float]) -> Callable[[Any], None]:
    """A chain step that adds ``logit_bias`` to its tokens' logits (-100 bans a token, 100 all but forces it).

    It runs before any step that sorts or trims the candidates, where they are the whole vocabulary in id
    order; the gateway checked that every id is in the vocabulary.
    """
    items = list(biases.items())

    def apply(candidates: Any) -> None:
        data = candidates.contents.data
        for token, bias in items:
            data[token].logit += bias

    return apply


def token_logprob(logits_pointer: Any, n_vocab: int, token: int, top: int) -> TokenLogprob:
    """``token``'s log probability under the model's own distribution at a decoded position (before
    temperature, penalties or a grammar, as vLLM and OpenAI report it), and the ``top`` likeliest
    tokens there. Costs ~0.3 ms for SmolLM2's 49k-token vocabulary."""
    import numpy as np

    logits = np.ctypeslib.as_array(logits_pointer, shape=(n_vocab,))
    peak = float(logits.max())
    log_total = peak + float(np.log(np.exp(logits - peak).sum()))
    likeliest: list[tuple[int, float]] = []
    if top > 0:
        ids = np.argpartition(logits, -top)[-top:]
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        likeliest = [(int(i), float(logits[i]) - log_total) for i in ids]
    return TokenLogprob(float(logits[token]) - log_total, likeliest)


def prompt_logprobs(rows: Any, targets: list[int], top: int) -> list[TokenLogprob]:
    """The log probability of ``targets[i]`` under the logits of row ``i`` of ``rows`` (a float32 matrix, one
    decoded prompt position a row: each predicts the prompt's next token), and the ``top`` likeliest tokens
    there; the numbers ``token_logprob`` gives for one row, computed for a whole prompt chunk at once."""
    import numpy as np

    peak = rows.max(axis=1)
    log_total = peak.astype(np.float64) + np.log(np.exp(rows - peak[:, None]).sum(axis=1)).astype(np.float64)
    picked = rows[np.arange(len(targets)), targets].astype(np.float64) - log_total
    likeliest: list[list[tuple[int, float]]] = [[] for _ in targets]
    if top > 0:
        ids = np.argpartition(rows, -top, axis=1)[:, -top:]
        for index, row_ids in enumerate(ids):
            ordered = row_ids[np.argsort(-rows[index, row_ids], kind="stable")]
            likeliest[index] = [(int(i), float(rows[index, i]) - float(log_total[index])) for i in ordered]
    return [TokenLogprob(float(value), alternatives) for value, alternatives in zip(picked, likeliest, strict=True)]


@functools.lru_cache(maxsize=64)
def json_schema_grammar(schema: str) -> Any:
    """llama.cpp's grammar for a JSON schema (JSON text), kept for the next request with the same schema.

    Raises RequestRejected when llama.cpp's converter cannot express the schema (it supports most of
    JSON Schema, not all: e.g. ``{"type": "bogus"}`` or a ``$ref`` to another document).
    """
    from llama_cpp.llama_grammar import LlamaGrammar

    try:
        return LlamaGrammar.from_json_schema(schema, verbose=False)
    except Exception as exc:  # the converter raises assertions, ValueErrors, KeyErrors...
        raise RequestRejected(
            f"llama.cpp cannot turn this JSON schema into a grammar: {type(exc).__name__}: {exc}"
        ) from exc
