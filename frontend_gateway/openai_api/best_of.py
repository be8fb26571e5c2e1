"""``best_of`` on completions, as vLLM serves it: ``best_of`` candidates per prompt are generated, and the ``n``
with the highest cumulative log probability are returned, best first.

The candidates are a completion batch (completion_batch.py) of each prompt ``best_of`` times, with log
probabilities asked of the engine (``logprobs: 0`` when the client asked none; they are then left out of
the answer). So ``best_of`` needs an engine that reports them (llama.cpp, vLLM); elsewhere it is refused,
as are a stream (as OpenAI refuses it: the best is known only at the end) and ``best_of`` below ``n``. Usage
counts every candidate's tokens, as OpenAI bills them.
"""

from dataclasses import dataclass
from typing import Any

import msgspec

from frontend_gateway.errors import InvalidRequest
from frontend_gateway.models.pipeline import Generation
from frontend_gateway.openai_api.types import CompletionRequest

__all__ = ["BestOf", "plan", "unsupported"]


@dataclass(frozen=True, slots=True)
class BestOf:
    """How to pick an answer's choices from its candidates, ``best_of`` per prompt in a row."""

    best_of: int
    n: int
    #: The request that generates the candidates: ``n`` is ``best_of``, with log probabilities.
    candidates: CompletionRequest
    #: Whether the client asked for log probabilities (else the choices carry none).
    show_logprobs: bool

    def pick(self, choices: list[dict[str, Any]], generations: list[Generation]) -> list[dict[str, Any]]:
        """The ``n`` best of each prompt's candidate choices, best first, numbered as ``n`` choices are."""
        picked: list[dict[str, Any]] = []
        for prompt, start in enumerate(range(0, len(choices), self.best_of)):
            group = range(start, start + self.best_of)
            ranked = sorted(group, key=lambda index: -_cumulative_logprob(generations[index]))[: self.n]
            for number, index in enumerate(ranked):
                choice = choices[index] | {"index": prompt * self.n + number}
                if not self.show_logprobs:
                    choice["logprobs"] = None
                picked.append(choice)
        return picked


def _cumulative_logprob(generation: Generation) -> float:
    # A prompt's first token has no log probability (None, with echo): the same for every candidate.
    return sum(entry.logprob for entry in generation.logprobs or () if entry.logprob is not None)


def plan(request: CompletionRequest) -> BestOf | None:
    """How to serve ``request``'s best_of; None when there is nothing to pick (best_of absent, or n).
    Raises InvalidRequest for best_of below n, or with a stream."""
    best_of, n = request.best_of, request.n or 1
    if best_of is None:
        return None
    if best_of < n:
        raise InvalidRequest(f"best_of ({best_of}) must be at least n ({n})", param="best_of")
    if best_of == 1:
        return None
    if request.stream:
        raise InvalidRequest(
            "best_of cannot be streamed: the best candidates are known only when all have ended; "
            "leave stream out, or use n",
            param="best_of",
        )
    if best_of == n:
        return None  # every candidate is returned: n choices
    asked = request.logprobs is not None and request.logprobs is not False
    candidates = msgspec.structs.replace(request, n=best_of, best_of=None, logprobs=request.logprobs if asked else 0)
    return BestOf(best_of, n, candidates, asked)


def unsupported(model: str, exc: InvalidRequest) -> InvalidRequest:
    """The error for best_of on a model whose engine refused the log probabilities it needs (``exc``)."""
    return InvalidRequest(
        f"best_of needs log probabilities to pick the best candidates, and model {model!r}'s engine does not "
        f"report them ({exc.message}); llama.cpp and vLLM do. Leave best_of out, or use n",
        param="best_of",
    )
