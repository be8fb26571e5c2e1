"""A request's constraint (a JSON schema, a regex, a choice, a grammar) as the grammar backends of SGLang and
TensorRT-LLM take it: one of a JSON schema, a regex or an EBNF grammar; a choice becomes the regex whose matches
are exactly its strings (neither has a choice of its own). Pure: no engine imported."""

from typing import Literal

from runtime.protocol import PreprocessedRequest

#: What the cards of these engines say they follow of guided decoding (``ModelCard.guided_decoding``): the four
#: constraints, not vLLM's JSON options (neither engine's sampling parameters have a field for them).
GUIDED_KINDS = ["json", "regex", "choice", "grammar"]

# The characters a regex reads as operators: escaped in a choice's strings, so that each matches as written.
_REGEX_OPERATORS = frozenset(".^$*+?{}[]\\|()/")

ConstraintKind = Literal["json", "regex", "grammar"]


def grammar_constraint(request: PreprocessedRequest) -> tuple[ConstraintKind, str] | None:
    """``request``'s constraint as (kind, text): a JSON schema, a regex or an EBNF grammar; None for a free
    answer. The gateway sends one constraint at a time."""
    if request.json_schema is not None:
        return "json", request.json_schema
    guided = request.guided
    if guided is None:
        return None
    if guided.regex is not None:
        return "regex", guided.regex
    if guided.choice is not None:
        return "regex", choice_regex(guided.choice)
    if guided.grammar is not None:
        return "grammar", guided.grammar
    return None


def choice_regex(choices: list[str]) -> str:
    """A regex whose matches are exactly ``choices`` (vLLM's ``guided_choice``)."""
    return "(" + "|".join("".join("\\" + c if c in _REGEX_OPERATORS else c for c in text) for text in choices) + ")"
