"""Guided decoding on llama.cpp: a request's constraint as one llama.cpp grammar (GBNF), checked before it runs.

A JSON schema goes through llama.cpp's converter (``sampling.json_schema_grammar``); a choice becomes a grammar
whose sentences are exactly its strings; a grammar (``guided_grammar``) is GBNF, as given. The grammar masks
every token that would leave it, and once a sentence is complete it allows only end-of-generation tokens, so
the answer ends there.

A regex is not followed: llama.cpp's regex-to-GBNF converter (the one its JSON-schema converter uses for
``pattern``) handles a subset and gets the rest wrong without saying so (``\\d{2}`` becomes the literal text
``\\d\\d``, ``.*?`` a grammar that does not parse), so an answer could be held to something else than the
regex says. The card does not list ``regex`` (``GUIDED_KINDS``), and the gateway refuses it naming the field.
"""

from typing import Any

from engines.llamacpp.sampling import json_schema_grammar
from runtime.errors import RequestRejected
from runtime.protocol import GuidedDecoding, PreprocessedRequest

#: What the card says llama.cpp follows of guided decoding (``ModelCard.guided_decoding``).
GUIDED_KINDS = ["json", "choice", "grammar"]

# GBNF literals are double-quoted, with C-like escapes (llama.cpp's grammars/README.md).
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def choice_grammar(choices: list[str]) -> str:
    """A GBNF grammar whose sentences are exactly ``choices`` (vLLM's ``guided_choice``)."""
    return "root ::= " + " | ".join(_literal(choice) for choice in choices)


def _literal(text: str) -> str:
    escaped = "".join(_ESCAPES.get(char) or (f"\\x{ord(char):02X}" if ord(char) < 0x20 else char) for char in text)
    return f'"{escaped}"'


def request_grammar(model: Any, request: PreprocessedRequest) -> Any:
    """The llama.cpp grammar (a ``LlamaGrammar``) that holds ``request``'s answer to its constraint; None: none.

    Blocking (a JSON schema's conversion, the grammar's parse): run it on a thread. ``model``: the engine's
    ``LlamaModel``, whose vocabulary the grammar is checked against. Raises RequestRejected for what llama.cpp
    cannot follow: a grammar that does not parse, a JSON schema it cannot express, a regex, JSON options.
    """
    from llama_cpp.llama_grammar import LlamaGrammar

    guided = request.guided or GuidedDecoding()
    _refuse_what_is_not_followed(guided)
    if request.json_schema is not None:
        grammar, what = json_schema_grammar(request.json_schema), "the JSON schema's grammar"
    elif guided.choice is not None:
        grammar, what = LlamaGrammar.from_string(choice_grammar(guided.choice), verbose=False), "guided_choice"
    elif guided.grammar is not None:
        grammar, what = LlamaGrammar.from_string(guided.grammar, verbose=False), "guided_grammar"
    else:
        return None
    _check(model, grammar, what)
    return grammar


def _refuse_what_is_not_followed(guided: GuidedDecoding) -> None:
    # The gateway refuses these for a card that does not list them; an older gateway may not know to.
    if guided.regex is not None:
        raise RequestRejected(
            "out=llamacpp does not follow a regex (guided_regex): llama.cpp's conversion of a regex to a grammar "
            "is partial; write the constraint as guided_grammar (GBNF)"
        )
    if guided.whitespace_pattern is not None or guided.disable_any_whitespace or guided.disable_additional_properties:
        raise RequestRejected(
            "out=llamacpp has no JSON options (whitespace_pattern, disable_any_whitespace, "
            "disable_additional_properties): its JSON grammars allow a little whitespace and the schema's properties"
        )


def _check(model: Any, grammar: Any, what: str) -> None:
    """Raise RequestRejected unless llama.cpp parses ``grammar``: a sampler chain given one that does not parse
    holds a null step, and its first token is a segmentation fault of the whole process (llama-cpp-python 0.3)."""
    import llama_cpp

    sampler = llama_cpp.llama_sampler_init_grammar(model.vocab, grammar._grammar.encode(), grammar._root.encode())
    if not sampler:
        raise RequestRejected(
            f"llama.cpp cannot parse {what} (GBNF, with a root rule: see llama.cpp's grammars/README.md); "
            "the worker's log has its parser's message"
        )
    llama_cpp.llama_sampler_free(sampler)
