"""The tokenizer encodes, decodes and renders chat templates exactly as transformers does,
for the default GGUF (tokenizer rebuilt from GGUF metadata), for an HF folder, and for the
embedding default's WordPiece folder (all-MiniLM-L6-v2: [CLS]/[SEP] added, and none of the
truncation or padding its tokenizer.json saves)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.models.info.paths import default_embedding_model_path
from gateway.tokenizer import TemplateError, Tokenizer, load_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "numbers 1234567 3.14159 2024-01-01 and 10,000",
    "café naïve Ωμέγα 日本語 中文 한국어 Привет",
    "emoji 🤖🚀 and a family 👨‍👩‍👧 ok",
    "tabs\tand\nnewlines\r\n\n\nend",
    "def f(x):\n    return x ** 2  # square",
    "I'm sure you're right, they've said we'll see; he'd know it's",
    "<|im_start|>user\nhi<|im_end|>\n",
    "special <|endoftext|> in the middle<|im_end|>",
    "",
    " ",
    "a" * 300,
    "Résumé of a long text: " + "the quick brown fox jumps over the lazy dog, " * 30,
]
MESSAGES = [{"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "What is 2+2? 🤔"}]


@pytest.fixture(scope="module")
def minilm_pair() -> tuple[Tokenizer, object]:
    from transformers import AutoTokenizer

    folder = default_embedding_model_path()
    return load_tokenizer("all-MiniLM-L6-v2"), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("pair", ["gguf_pair", "folder_pair", "minilm_pair"])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(request: pytest.FixtureRequest, pair: str,
                                              text: str) -> None:
    ours, theirs = request.getfixturevalue(pair)
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)


def test_minilm_adds_cls_and_sep_and_neither_truncates_nor_pads(
        minilm_pair: tuple[Tokenizer, object]) -> None:
    ours, _ = minilm_pair
    assert ours.encode("hi") == [101, 7632, 102]  # [CLS] hi [SEP], no padding to 128
    assert len(ours.encode("word " * 600)) == 602  # past its saved 128 and the model's 512


@pytest.mark.parametrize("pair", ["gguf_pair", "folder_pair"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(request: pytest.FixtureRequest, pair: str,
                                           add_generation_prompt: bool) -> None:
    ours, theirs = request.getfixturevalue(pair)
    expected = theirs.apply_chat_template(MESSAGES, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt) == expected


def test_default_model_special_tokens(gguf_pair: tuple[Tokenizer, object]) -> None:
    ours, theirs = gguf_pair
    assert ours.vocab_size == len(theirs) == 49152  # type: ignore[arg-type]
    assert ours.bos_token_id == 1
    assert ours.eos_token_ids == [2]  # <|im_end|>: the eos and the template's end of turn
    assert ours.convert_ids_to_tokens(ours.encode("héllo wörld")) == \
        theirs.convert_ids_to_tokens(ours.encode("héllo wörld"))  # type: ignore[attr-defined]


def test_tokens_join_back_into_text(gguf_pair: tuple[Tokenizer, object]) -> None:
    ours, _ = gguf_pair
    ids = ours.encode("Grüße, 世界 🌍!")
    tokens = ours.convert_ids_to_tokens(ids)
    assert ours.convert_tokens_to_string(tokens) == "Grüße, 世界 🌍!"
    assert "\ufffd" in ours.convert_tokens_to_string(tokens[:-2])  # a cut emoji


def test_end_of_turn_tokens_of_the_template_stop_generation(
        folder_pair: tuple[Tokenizer, object]) -> None:
    ours, _ = folder_pair
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids


def test_raise_exception_in_a_template(folder_pair: tuple[Tokenizer, object]) -> None:
    ours, _ = folder_pair
    ours = Tokenizer(ours.tokenizer, chat_template=(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}ok"), bos_token=None, eos_token=None)
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError, match="first must be user"):
        ours.apply_chat_template([{"role": "system", "content": "x"}])


def test_templates_run_sandboxed(folder_pair: tuple[Tokenizer, object]) -> None:
    import jinja2.exceptions

    ours, _ = folder_pair
    ours = Tokenizer(ours.tokenizer, chat_template="{{ messages.__class__.__mro__ }}",
                     bos_token=None, eos_token=None)
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template([])


def test_no_chat_template_is_a_clear_error(folder_pair: tuple[Tokenizer, object]) -> None:
    ours, _ = folder_pair
    ours = Tokenizer(ours.tokenizer, chat_template=None, bos_token=None, eos_token=None)
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template(MESSAGES)


def test_missing_tokenizer_json_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
