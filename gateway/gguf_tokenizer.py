"""A `tokenizers.Tokenizer` rebuilt from a GGUF file's vocabulary (any process that loads the
tokenizer; torch-free).

GGUF carries no tokenizer.json: `tokenizer.ggml.model` says which kind the vocabulary is,
and the tokenizer is built the way transformers builds it for the same file, so both
encode and decode alike: `gpt2` (byte-level BPE) or `llama` (SentencePiece BPE). Control
tokens stay whole and are special (skipped on decode); user-defined ones stay whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as FastTokenizer
from tokenizers.models import BPE

from gateway.models.info.gguf_file import GGUFFile

# tokenizer.ggml.token_type values.
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
_SPACE = "\u2581"  # SentencePiece's spelling of a space
# GGUF pre-tokenizer names whose split regex differs from GPT-2's (as transformers maps them).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
                "deepseek-r1-qwen": _QWEN2_SPLIT}
# Names that mean GPT-2's own split (ByteLevel's regex), as transformers reads them;
# None: a file that names no pre-tokenizer.
_GPT2_SPLIT_NAMES = frozenset({None, "default", "gpt2", "gpt-2", "smollm"})
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(str(n) for n in _GPT2_SPLIT_NAMES | set(_GGUF_SPLITS)
                                        if n is not None))


@dataclass
class GGUFVocabulary:
    """The tokenizer and the texts of its special tokens."""

    tokenizer: FastTokenizer
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    add_eos_token: bool


def build_gguf_tokenizer(gguf: GGUFFile) -> GGUFVocabulary:
    """The tokenizer `gguf`'s metadata describes; ValueError naming what is not supported."""
    kind = gguf.get("tokenizer.ggml.model")
    tokens: list[str] = gguf.get("tokenizer.ggml.tokens") or []
    types: list[int] = gguf.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level(gguf, tokens, types)
    elif kind == "llama":
        tokenizer = _sentencepiece(gguf, tokens, types)
    else:
        raise ValueError(f"{gguf.path}: GGUF tokenizer type {kind!r} is not supported "
                         f"(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece BPE)")

    def token(key: str) -> str | None:
        token_id = gguf.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary that does not say.
    add_bos = gguf.get("tokenizer.ggml.add_bos_token", kind == "llama")
    return GGUFVocabulary(tokenizer, token("bos_token_id"), token("eos_token_id"),
                          bool(add_bos), bool(gguf.get("tokenizer.ggml.add_eos_token")))


# ------------------------------------------------------------------ byte-level BPE
@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the spelling of byte-level vocabularies)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _byte_level(gguf: GGUFFile, tokens: list[str], types: list[int]) -> FastTokenizer:
    """Byte-level BPE (`gpt2`): `tokens` + `merges`, split by the regex `tokenizer.ggml.pre`
    names (a name we do not know is refused: GPT-2's split would give other tokens).
    """
    pre = gguf.get("tokenizer.ggml.pre")
    if pre not in _GPT2_SPLIT_NAMES and pre not in _GGUF_SPLITS:
        raise ValueError(f"{gguf.path}: GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not "
                         f"supported: its split would differ from GPT-2's and give wrong "
                         f"tokens (supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})")
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {(t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in gguf.get("tokenizer.ggml.merges") or []]
    tokenizer = FastTokenizer(BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                              end_of_word_suffix="", fuse_unk=False))
    split = _GGUF_SPLITS.get(str(pre))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel: skipped.
    _add_whole_tokens(tokenizer, [(t, k) for t, k in zip(tokens, types)
                                  if k != _CONTROL or set(t) <= spelled], vocab)
    return tokenizer


# ------------------------------------------------------------------ SentencePiece BPE
def _sentencepiece(gguf: GGUFFile, tokens: list[str], types: list[int]) -> FastTokenizer:
    """SentencePiece BPE (`llama`: Llama 2, Mistral): `tokens` spelled with '▁' for spaces,
    merges ranked by `scores` (when the file has none), `<0xNN>` byte fallback, a '▁' prefix
    when `add_space_prefix` says so.
    """
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # first id of a repeat
    scores: list[float] = gguf.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    given = gguf.get("tokenizer.ggml.merges")
    merges = ([tuple(m.split(" ", 1)) for m in given] if given
              else _merges_from_scores(tokens, scores, types, vocab))
    unk_id = gguf.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tokenizer = FastTokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                  byte_fallback=True))
    # SentencePiece sees the text as one piece with spaces spelled '▁', a '▁' in front of
    # the first word (not after special tokens: transformers' non-legacy Llama tokenizer).
    add_prefix = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if add_prefix else "never", split=False)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(
        steps + ([decoders.Strip(content=" ", left=1, right=0)] if add_prefix else []))
    _add_whole_tokens(tokenizer, list(zip(tokens, types)), vocab)
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int],
                        vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a normal piece into two
    pieces of the vocabulary, best piece score first (longer left part first on a tie), as
    transformers derives them; SentencePiece merges the pair whose result scores best."""
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for index, (piece, score, kind) in enumerate(zip(tokens, scores, types)):
        if kind != _NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, -len(left), -len(right), index, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_whole_tokens(tokenizer: FastTokenizer, typed: list[tuple[str, int]],
                      vocab: dict[str, int]) -> None:
    """Control tokens stay whole and are special; user-defined ones stay whole only."""
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t, kind in typed if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                          for t, kind in typed if kind == _USER_DEFINED and t in vocab])
