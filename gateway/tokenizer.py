"""The tokenizer and chat template (torch-free: the front end uses it).

From an HF folder: tokenizer.json + tokenizer_config.json (+ chat_template.jinja,
generation_config.json). From a GGUF file: the tokenizer its vocabulary describes (byte-level
or SentencePiece BPE, see gguf_tokenizer), built as transformers builds it for the same file.

The chat template: the GGUF's own (`tokenizer.chat_template`); else the folder's
chat_template.jinja, else its tokenizer_config.json's `chat_template` (for a GGUF, the folder
it lies in). `--chat-template` replaces it (the serving layer applies that).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as FastTokenizer
from tokenizers import processors

from gateway.gguf_tokenizer import build_gguf_tokenizer
from gateway.models.info.gguf_file import GGUFFile
from gateway.models.info.paths import resolve_model_path
from gateway.template_sandbox import DEFAULT_MAX_CHARS, TemplateError, render_template

__all__ = ["END_OF_TURN_TOKENS", "TemplateError", "Tokenizer", "load_tokenizer"]

# Tokens that close a chat turn; when the chat template writes one, generation stops on it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>",
                      "<|endoftext|>")
_BERT_TOKENIZER_CLASSES = ("BertTokenizer", "BertTokenizerFast")
#: Texts longer than this (characters), or more token ids, are encoded or decoded by the
#: tokenizers library's batch calls, which hand the GIL back while the Rust code runs (the
#: single calls keep it: 2,000,000 ids held the front end's event loop 0.9 s).
LONG_INPUT = 8192


class Tokenizer:
    """Encode, decode and render chat templates for one model."""

    def __init__(self, tokenizer: FastTokenizer, *, chat_template: str | None,
                 bos_token: str | None, eos_token: str | None,
                 extra_eos_token_ids: Sequence[int] = (), clean_up_spaces: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._clean_up_spaces = clean_up_spaces
        self.bos_token_id = self.token_to_id(bos_token)
        eos_ids = [self.token_to_id(eos_token)] + list(extra_eos_token_ids)
        eos_ids += [self.token_to_id(t) for t in END_OF_TURN_TOKENS
                    if chat_template is not None and t in chat_template]
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos_ids if i is not None))
        self.all_special_ids = sorted(i for i, t in tokenizer.get_added_tokens_decoder().items()
                                      if t.special)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > LONG_INPUT:  # the batch call lets other threads run meanwhile
            encoding = self.tokenizer.encode_batch(
                [text], add_special_tokens=add_special_tokens)[0]
        else:
            encoding = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > LONG_INPUT:
            text: str = self.tokenizer.decode_batch(
                [list(ids)], skip_special_tokens=skip_special_tokens)[0]
        else:
            text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up_spaces else text

    def convert_ids_to_tokens(self, ids: Sequence[int],
                              skip_special_tokens: bool = False) -> list[str]:
        """Token strings in the vocabulary's own spelling (byte-level BPE: 'Ġ' for space)."""
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.tokenizer.id_to_token(i) or "" for i in ids if i not in special]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        """Join token strings into text with the tokenizer's decoder (for incremental
        detokenization; an incomplete UTF-8 sequence shows as U+FFFD)."""
        decoder = self.tokenizer.decoder
        return decoder.decode(list(tokens)) if decoder is not None else "".join(tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, *,
                            chat_template: str | None = None,
                            max_chars: int = DEFAULT_MAX_CHARS, **kwargs: Any) -> str:
        """Render `messages` with `chat_template`, else the model's (a sandboxed jinja2
        template, gateway/template_sandbox.py); `kwargs` are extra template variables.
        TemplateOutputError when the text would pass `max_chars`."""
        source = self.template_source(chat_template)
        return render_template(source, self.template_variables(
            messages, add_generation_prompt, **kwargs), max_chars)

    def template_source(self, chat_template: str | None = None) -> str:
        source = chat_template or self.chat_template
        if not source:
            raise ValueError("This model has no chat template; use the completions API or "
                             "pass one with --chat-template")
        return source

    def template_variables(self, messages: Sequence[dict[str, Any]],
                           add_generation_prompt: bool = True, **kwargs: Any
                           ) -> dict[str, Any]:
        """What a chat template sees: the special tokens, `kwargs`, the messages."""
        return {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                **kwargs, "messages": list(messages),
                "add_generation_prompt": add_generation_prompt}


def load_tokenizer(model: str | Path | None) -> Tokenizer:
    """The tokenizer of a .gguf file or an HF folder (None: the default model)."""
    path = resolve_model_path(None if model is None else str(model))
    if path.is_dir():
        return _load_hf_tokenizer(path)
    return _load_gguf_tokenizer(GGUFFile(path))


# ------------------------------------------------------------------ GGUF
def _load_gguf_tokenizer(gguf: GGUFFile) -> Tokenizer:
    vocabulary = build_gguf_tokenizer(gguf)
    bos, eos = vocabulary.bos_token, vocabulary.eos_token
    _set_bos_eos_processor(vocabulary.tokenizer, bos if vocabulary.add_bos_token else None,
                           eos if vocabulary.add_eos_token else None)
    # The file's own template first; a file without one takes its folder's.
    template = gguf.get("tokenizer.chat_template") or _folder_chat_template(gguf.path.parent)
    return Tokenizer(vocabulary.tokenizer, chat_template=template, bos_token=bos, eos_token=eos)


def _set_bos_eos_processor(tokenizer: FastTokenizer, bos: str | None, eos: str | None) -> None:
    if bos is None and eos is None:
        return
    prefix, suffix = ([f"{bos}:0"] if bos else []), ([f"{eos}:0"] if eos else [])
    single = " ".join(prefix + ["$A:0"] + suffix)
    pair = " ".join(prefix + ["$A:0"] + suffix + prefix + ["$B:1"] + suffix)
    special = [(t, tokenizer.token_to_id(t)) for t in (bos, eos) if t is not None]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(special)))


# ------------------------------------------------------------------ HF folders
def _load_hf_tokenizer(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"Model folder {folder} has no tokenizer.json")
    tokenizer = FastTokenizer.from_file(str(path))
    # Truncation and padding saved in tokenizer.json (MiniLM's: 128 tokens, both) are not
    # ours to apply: the front end decides per request, as transformers does.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    config = _read_json(folder / "tokenizer_config.json")
    if config.get("tokenizer_class") in _BERT_TOKENIZER_CLASSES:
        _set_cls_sep_processor(tokenizer, config)
    template = _folder_chat_template(folder, config)
    generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
    extra_eos = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    model_type = type(tokenizer.model).__name__
    return Tokenizer(
        tokenizer, chat_template=template, bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")), extra_eos_token_ids=extra_eos,
        clean_up_spaces=bool(config.get("clean_up_tokenization_spaces")) and model_type != "BPE")


def _folder_chat_template(folder: Path, config: dict[str, Any] | None = None) -> str | None:
    """A folder's chat template: chat_template.jinja, else tokenizer_config.json's entry
    (transformers reads them in that order: the .jinja file is its newer spelling)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = (config if config is not None
                else _read_json(folder / "tokenizer_config.json")).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _set_cls_sep_processor(tokenizer: FastTokenizer, config: dict[str, Any]) -> None:
    """[CLS] text [SEP] (pairs: [CLS] a [SEP] b [SEP]), which transformers' BertTokenizer
    sets whatever tokenizer.json holds."""
    cls = _token_text(config.get("cls_token")) or "[CLS]"
    sep = _token_text(config.get("sep_token")) or "[SEP]"
    cls_id, sep_id = tokenizer.token_to_id(cls), tokenizer.token_to_id(sep)
    if cls_id is None or sep_id is None:
        raise ValueError(f"The tokenizer's vocabulary lacks its {cls!r} or {sep!r} token")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, cls_id), (sep, sep_id)])


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization (WordPiece tokenizers only)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):
        text = text.replace(before, after)
    return text
