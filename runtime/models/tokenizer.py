"""Tokenizers from a GGUF file's metadata or a Hugging Face ``tokenizer.json``.

A GGUF file carries its vocabulary but no ``tokenizer.json``. We rebuild an equivalent fast tokenizer
(``tokenizers``) from the metadata so that the gateway can tokenize for any engine, and it must give the
very ids llama.cpp gives: the pre-tokenizer regexes and the special-token rules below are copied from
llama.cpp's ``llama-vocab.cpp``, keyed by ``tokenizer.ggml.pre``.
"""

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from runtime.errors import ModelError

# llama.cpp's token types (``tokenizer.ggml.token_type``).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Tokens llama.cpp recognizes by their text alone (llama-vocab.cpp): these end generation ...
_EOG_TEXTS = _words(
    "<|eot_id|> <|im_end|> <|end|> <|return|> <|call|> <|flush|> <|calls|> <end_of_turn> <|endoftext|> </s>"
    " <|eom_id|> <EOT> _<EOT> [EOT] [EOS] <|end_of_text|> <end_of_utterance> <eos> <turn|> <|tool_response>"
)
# ... and these, with them, are made control tokens (cut out of the text before BPE) whatever their type.
_CONTROL_TEXTS = _EOG_TEXTS | _words(
    "<｜end▁of▁sentence｜> <|fim_prefix|> <fim-prefix> <fim_prefix> <｜fim▁begin｜> <PRE> ▁<PRE> <|code_prefix|>"
    " <|fim_suffix|> <fim-suffix> <fim_suffix> <｜fim▁hole｜> <SUF> ▁<SUF> <|code_suffix|> <|fim_middle|>"
    " <fim-middle> <fim_middle> <｜fim▁end｜> <MID> ▁<MID> <|code_middle|> <|fim_pad|> <fim-pad> <fim_pad> <PAD>"
    " [PAD] <|fim_repo|> <|repo_name|> <fim-repo> <REPO> <reponame> <|file_sep|>"
)
_HARMONY_TEXTS = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})


def _token_kinds(tokens: list[str], types: list[int]) -> tuple[list[int], set[str]]:
    """Return each token's type after llama.cpp's text-based overrides, and the EOG texts in force."""
    present = set(tokens)
    eog = set(_EOG_TEXTS & present)
    normal: set[str] = set()
    user_defined = set(_HARMONY_TEXTS & present)
    # gpt-oss / solar-open: "<|end|>" separates messages there and must not stop generation.
    if "<|end|>" in present and ({"<|return|>", "<|call|>"} <= present or {"<|calls|>", "<|flush|>"} <= present):
        eog.discard("<|end|>")
        user_defined.add("<|end|>")
    # gemma4: "</s>" is ordinary text (HTML strikethrough) there.
    if "<|tool_response>" in present and "</s>" in present:
        eog.discard("</s>")
        normal.add("</s>")
    kinds = []
    for token, kind in zip(tokens, types, strict=True):
        if token in normal:
            kind = _NORMAL
        elif token in user_defined:
            kind = _USER_DEFINED
        elif token in _CONTROL_TEXTS:
            kind = _CONTROL
        kinds.append(kind)
    return kinds, eog


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class _PreTokenizer:
    """How llama.cpp splits text before BPE for one family of ``tokenizer.ggml.pre`` values."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is a whole token is not split (llama3 style)
    add_bos: bool = False  # llama.cpp's default when the GGUF has no add_bos_token key


_LLAMA3_STYLE = _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_SMOLLM_STYLE = _PreTokenizer((r"\p{N}", _GPT2))  # starcoder family: every digit on its own
_GPT2_STYLE = _PreTokenizer((_GPT2,))
_QWEN2_STYLE = _PreTokenizer((_QWEN2,))

# tokenizer.ggml.pre values, grouped as llama.cpp groups them.
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _PreTokenizer(_DEFAULT),
    "falcon": _PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **dict.fromkeys(_words("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2"), _LLAMA3_STYLE),
    **dict.fromkeys(_words("dbrx smaug-bpe"), _PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(_words("smollm starcoder refact command-r codeshell exaone minerva-7b"), _SMOLLM_STYLE),
    **dict.fromkeys(
        _words(
            "gpt-2 gpt2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum jina-v1-en"
            " jina-v2-code roberta-bpe mpt olmo jais trillion granite-docling exaone4"
        ),
        _GPT2_STYLE,
    ),
    **dict.fromkeys(_words("qwen2 deepseek-r1-qwen kormo stablelm2 megrez hunyuan"), _QWEN2_STYLE),
}


@dataclass(frozen=True)
class GGUFMetadata:
    """What a model card needs from a GGUF file besides the tokenizer."""

    architecture: str
    context_length: int | None
    bos_token_id: int | None
    eos_token_id: int | None
    bos_token: str | None
    eos_token: str | None
    #: Every id that ends generation: EOS, EOT/EOM, and tokens llama.cpp recognizes by their text.
    eos_token_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None


class GGUFFile:
    """The metadata (key/value section) of a GGUF file, read once; tensors are not touched."""

    def __init__(self, path: Path, values: dict[str, Any]) -> None:
        self.path = path
        self.values = values


def open_gguf(path: Path) -> GGUFFile:
    """Read a GGUF file's metadata. Raises ModelError if it is missing or not a GGUF file."""
    if not path.is_file():
        raise ModelError(f"GGUF file {str(path)!r} does not exist")
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return GGUFFile(path, _read_key_values(data))
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ModelError(f"{str(path)!r} is not a readable GGUF file: {exc}") from exc


# GGUF value types (gguf.GGUFValueType) as struct codes; 8 is a string and 9 an array.
_STRUCT_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _read_key_values(data: mmap.mmap) -> dict[str, Any]:
    """Parse the header and key/value section of a GGUF file (format version 2 or 3).

    gguf's GGUFReader builds a numpy view per array element, which takes seconds for a large vocabulary;
    a vocabulary here is read in a fraction of that.
    """
    if data[:4] != b"GGUF":
        raise ValueError("it does not start with the GGUF magic number")
    # Files written on big-endian machines read as versions like 0x03000000 in little-endian.
    order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"
    version, _, count = struct.unpack_from(f"{order}IQQ", data, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old")
    position = 24

    def string() -> str:
        nonlocal position
        (size,) = struct.unpack_from(f"{order}Q", data, position)
        start, position = position + 8, position + 8 + size
        if position > len(data):
            raise ValueError("it is truncated")
        return data[start:position].decode("utf-8", errors="replace")

    def value(kind: int) -> Any:
        nonlocal position
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item_kind, length = struct.unpack_from(f"{order}IQ", data, position)
            position += 12
            if item_kind in (_STRING, _ARRAY):
                return [value(item_kind) for _ in range(length)]
            if item_kind not in _STRUCT_CODES:
                raise ValueError(f"unknown array item type {item_kind}")
            items = struct.unpack_from(f"{order}{length}{_STRUCT_CODES[item_kind]}", data, position)
            position += struct.calcsize(f"{order}{length}{_STRUCT_CODES[item_kind]}")
            return list(items)
        if kind not in _STRUCT_CODES:
            raise ValueError(f"unknown value type {kind}")
        (scalar,) = struct.unpack_from(f"{order}{_STRUCT_CODES[kind]}", data, position)
        position += struct.calcsize(_STRUCT_CODES[kind])
        return scalar

    values: dict[str, Any] = {}
    for _ in range(count):
        key = string()
        (kind,) = struct.unpack_from(f"{order}I", data, position)
        position += 4
        values[key] = value(kind)
    return values


def _file(reader: GGUFFile) -> str:
    return str(reader.path)


def _value(reader: GGUFFile, key: str) -> Any:
    return reader.values.get(key)


def _optional_int(reader: GGUFFile, key: str) -> int | None:
    value = _value(reader, key)
    return int(value) if value is not None else None


def _tokens(reader: GGUFFile) -> list[str]:
    tokens = _value(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelError(f"GGUF file {_file(reader)!r} has no tokenizer vocabulary")
    # llama.cpp renames empty tokens so that every text maps to one id; do the same.
    return [token or f"[EMPTY_{i}]" for i, token in enumerate(tokens)]


def gguf_metadata(reader: GGUFFile) -> GGUFMetadata:
    """Read context length, special tokens, stop ids and chat template from an open GGUF file."""
    architecture = str(_value(reader, "general.architecture") or "")
    tokens = _tokens(reader)

    def text(token_id: int | None) -> str | None:
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    bos_id = _optional_int(reader, "tokenizer.ggml.bos_token_id")
    eos_id = _optional_int(reader, "tokenizer.ggml.eos_token_id")
    stop_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = _optional_int(reader, f"tokenizer.ggml.{key}")
        if text(token_id) is not None and token_id not in stop_ids:
            stop_ids.append(token_id)  # type: ignore[arg-type]  # text() is not None only for an int
    _, eog = _token_kinds(tokens, _token_types(reader, len(tokens)))
    stop_ids += [i for i, token in enumerate(tokens) if token in eog and i not in stop_ids]
    template = _value(reader, "tokenizer.chat_template")
    return GGUFMetadata(
        architecture=architecture,
        context_length=_optional_int(reader, f"{architecture}.context_length"),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        bos_token=text(bos_id),
        eos_token=text(eos_id),
        eos_token_ids=stop_ids,
        chat_template=str(template) if template else None,
    )


def gguf_tokenizer(reader: GGUFFile) -> Tokenizer:
    """Build the fast tokenizer equivalent to llama.cpp's for an open GGUF file.

    ``encode(text, add_special_tokens=False)`` gives llama.cpp's ``tokenize(text, add_bos=False,
    special=True)``; with ``add_special_tokens=True`` BOS is prepended only when the model asks for it.
    Raises ModelError for vocabularies we cannot reproduce exactly.
    """
    model = _value(reader, "tokenizer.ggml.model")
    if model == "gpt2":
        return _byte_level_bpe(reader)
    if model == "llama":
        return _sentencepiece_bpe(reader)
    raise ModelError(
        f"tokenizer model {model!r} in {_file(reader)!r} is not supported; pass --model-config with a tokenizer.json"
    )


def _token_types(reader: GGUFFile, count: int) -> list[int]:
    types = _value(reader, "tokenizer.ggml.token_type")
    return [int(t) for t in types] if types else [_NORMAL] * count


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Register the tokens llama.cpp cuts out of the text first, so that "<|im_start|>" is one id.

    Control tokens become special (skipped when decoding with ``skip_special_tokens``); user-defined
    ones are matched the same way but decode as text.
    """
    kinds, _ = _token_kinds(tokens, types)
    control = [t for t, k in zip(tokens, kinds, strict=True) if k in (_CONTROL, _UNKNOWN)]
    user_defined = [t for t, k in zip(tokens, kinds, strict=True) if k == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])


def _add_bos_eos(reader: GGUFFile, tokenizer: Tokenizer, tokens: list[str], add_bos: bool) -> None:
    """Install a post-processor that adds BOS/EOS the way the GGUF says llama.cpp should."""
    flag = _value(reader, "tokenizer.ggml.add_bos_token")
    add_bos = add_bos if flag is None else bool(flag)
    add_eos = bool(_value(reader, "tokenizer.ggml.add_eos_token"))
    prefix: list[tuple[str, int]] = []
    suffix: list[tuple[str, int]] = []
    for wanted, key, side in ((add_bos, "bos", prefix), (add_eos, "eos", suffix)):
        token_id = _optional_int(reader, f"tokenizer.ggml.{key}_token_id")
        if wanted and token_id is not None and 0 <= token_id < len(tokens):
            side.append((tokens[token_id], token_id))
    if not prefix and not suffix:
        return
    single = [text for text, _ in prefix] + ["$A"] + [text for text, _ in suffix]
    pair = single + [f"{text}:1" for text, _ in prefix] + ["$B:1"] + [f"{text}:1" for text, _ in suffix]
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=prefix + suffix)


def _byte_level_bpe(reader: GGUFFile) -> Tokenizer:
    tokens = _tokens(reader)
    raw_merges = _value(reader, "tokenizer.ggml.merges") or []
    merges: list[tuple[str, str]] = []
    for merge in raw_merges:
        # llama.cpp splits at the first space after the first character ("Ġ Ġ" is two "Ġ").
        cut = merge.find(" ", 1)
        if cut > 0:
            merges.append((merge[:cut], merge[cut + 1 :]))
    pre_name = str(_value(reader, "tokenizer.ggml.pre") or "default")
    # llama.cpp falls back to its 'default' regexes for names it does not know; so do we.
    pre = _PRE_TOKENIZERS.get(pre_name, _PRE_TOKENIZERS["default"])
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelError(f"GGUF file {_file(reader)!r} has duplicate tokens in its vocabulary")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    splits: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre.regexes
    ]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    _add_special_tokens(tokenizer, tokens, _token_types(reader, len(tokens)))
    _add_bos_eos(reader, tokenizer, tokens, pre.add_bos)
    return tokenizer


def _sentencepiece_bpe(reader: GGUFFile) -> Tokenizer:
    """SentencePiece BPE (Llama 2, Gemma) as a ``tokenizers`` BPE with merges derived from the scores.

    llama.cpp's SPM tokenizer repeatedly joins the adjacent pair whose concatenation is the token with
    the highest score, and falls back to byte tokens for what is left. Ranking every (left, right) split
    of every token by that token's score gives a BPE model that makes the same choices, provided no
    two tokens share a score (true of real SentencePiece vocabularies, where the score is a rank).
    """
    tokens = _tokens(reader)
    types = _token_types(reader, len(tokens))
    scores = _value(reader, "tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise ModelError(
            f"SentencePiece vocabulary in {_file(reader)!r} has no scores; pass --model-config with a tokenizer.json"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    kinds, _ = _token_kinds(tokens, types)
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for i, token in enumerate(tokens):
        # Control and user-defined tokens are cut out of the text before the merges run.
        if kinds[i] in (_CONTROL, _USER_DEFINED, _UNKNOWN):
            continue
        for cut in range(1, len(token)):
            left, right = vocab.get(token[:cut]), vocab.get(token[cut:])
            if left is not None and right is not None:
                ranked.append((-float(scores[i]), i, left, right, token[:cut], token[cut:]))
    ranked.sort()
    unk_id = _optional_int(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for *_, left, right in ranked],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # SentencePiece sees the text with spaces as "▁" and no word splitting at all.
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", "▁")]
    decode_steps: list[decoders.Decoder] = [
        decoders.Replace("▁", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    add_space_prefix = _value(reader, "tokenizer.ggml.add_space_prefix")
    if add_space_prefix is None or add_space_prefix:
        # llama.cpp prefixes a space to every text fragment that follows a special token (or starts the
        # text); tokenizers normalizes each fragment between added tokens separately, which is the same.
        steps.append(normalizers.Prepend("▁"))
        decode_steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence(decode_steps)
    _add_special_tokens(tokenizer, tokens, types)
    _add_bos_eos(reader, tokenizer, tokens, add_bos=True)
    return tokenizer


def tokenizer_from_file(path: Path) -> Tokenizer:
    """Load a Hugging Face ``tokenizer.json``. Raises ModelError if it is missing or invalid."""
    if not path.is_file():
        raise ModelError(f"tokenizer file {str(path)!r} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise ModelError(f"tokenizer file {str(path)!r} cannot be loaded: {exc}") from exc
