"""Tokenizers rebuilt from GGUF vocabularies: SentencePiece (`tokenizer.ggml.model = llama`,
Llama 2 and Mistral style: '▁' spaces, byte fallback, merges from scores) encode and decode
as transformers' tokenizer for the same file and as SentencePiece itself; an unknown
pre-tokenizer is refused; the chat template comes from the GGUF, then its folder; and a
SentencePiece GGUF model is served by the real server."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import httpx
import pytest

from gateway.tokenizer import Tokenizer, load_tokenizer
from tests.models.tiny_gguf import add_sentencepiece_vocab, write_tiny_gguf, write_vocab_gguf
from tests.test_tokenizer import TEXTS

_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! A tiny vocabulary.",
           "def f(x):\n    return x ** 2  # square", "café naïve résumé Grüße Ωμέγα",
           "Once upon a time there was a server that answered.", "numbers 1234567 3.14159",
           "I'm sure you're right, they've said we'll see.", "    indented    code\n\n"] * 40
# Per family: the control and user-defined symbols its vocabulary has, and its chat template.
FAMILIES = {
    "llama2": ([], [], "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + "
               "'[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + ' ' "
               "+ eos_token }}{% endif %}{% endfor %}"),
    "mistral": (["[INST]", "[/INST]"], ["<tool>"], "{{ bos_token }}{% for m in messages %}"
                "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
                "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"),
    "phi3": (["<|user|>", "<|assistant|>", "<|end|>"], [], "{% for m in messages %}"
             "{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"),
    "gemma3": (["<start_of_turn>", "<end_of_turn>"], [], "{{ bos_token }}{% for m in messages %}"
               "{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] + '<end_of_turn>\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}"
               "{% endif %}"),
}
# general.architecture of each family's file (the vocabulary's rules may depend on it).
ARCHITECTURES = {"phi3": "phi3", "gemma3": "gemma3"}


def add_family_vocab(writer: gguf.GGUFWriter, family: str, proto: bytes) -> None:
    """The family's vocabulary as llama.cpp writes it (Gemma: no space prefix, runs of
    spaces spelled as spaces)."""
    is_gemma = family == "gemma3"
    add_sentencepiece_vocab(writer, proto, add_space_prefix=not is_gemma,
                            spaces_as_spaces=is_gemma)
SPM_TEXTS = [*TEXTS, "[INST] What is 2+2? [/INST] 4</s>", "call <tool> now", "a  b   c    d",
             "  two leading spaces", "<|user|>\n hi<|end|>\n<|assistant|>\n",
             "<start_of_turn>user\n  hi<end_of_turn>\n",
             "trailing  ", "\n\nnewlines first", "unknown ☃ snowman and 🦙 llama"]
MESSAGES = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is 2+2? 🤔"}]


def train_sentencepiece(family: str, *, add_dummy_prefix: bool = True) -> bytes:
    """A tiny SentencePiece BPE model trained as Llama 2's was (byte fallback, digits
    split, no normalisation, whitespace kept)."""
    import sentencepiece

    control, user_defined, _ = FAMILIES[family]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS), model_writer=model, model_type="bpe", vocab_size=420,
        byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        add_dummy_prefix=add_dummy_prefix, control_symbols=control,
        user_defined_symbols=user_defined, num_threads=1, minloglevel=2)
    return model.getvalue()


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Tokenizer, Any, Any]]:
    """Per family: ours, transformers' tokenizer for the same GGUF, SentencePiece itself."""
    import sentencepiece
    from transformers import AutoTokenizer

    made = {}
    for family, (_, _, template) in FAMILIES.items():
        proto = train_sentencepiece(family, add_dummy_prefix=family != "gemma3")
        folder = tmp_path_factory.mktemp(family)
        write_vocab_gguf(folder / "vocab.gguf",
                         lambda w, p=proto, f=family: add_family_vocab(w, f, p),
                         chat_template=template, arch=ARCHITECTURES.get(family, "llama"))
        made[family] = (load_tokenizer(folder / "vocab.gguf"),
                        AutoTokenizer.from_pretrained(folder, gguf_file="vocab.gguf"),
                        sentencepiece.SentencePieceProcessor(model_proto=proto))
    return made


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_gguf_encodes_and_decodes_as_transformers(
        families: dict[str, tuple[Tokenizer, Any, Any]], family: str, text: str) -> None:
    ours, theirs, _ = families[family]
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("text", [t for t in SPM_TEXTS if t[:1].strip()
                                  and not any(s in t for s in ("[INST]", "<tool>", "<|", "</s>",
                                                               "_of_turn>"))])
def test_sentencepiece_gguf_encodes_as_sentencepiece_itself(
        families: dict[str, tuple[Tokenizer, Any, Any]], family: str, text: str) -> None:
    """Texts not starting with whitespace: SentencePiece cuts a leading run of spaces into
    words before merging, which transformers and llama.cpp do not."""
    ours, _, processor = families[family]
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == processor.encode(text)
    assert ours.decode(ids) == processor.decode(ids)


def test_characters_outside_the_vocabulary_fall_back_to_bytes(
        families: dict[str, tuple[Tokenizer, Any, Any]]) -> None:
    ours, _, _ = families["llama2"]
    ids = ours.encode("🦙", add_special_tokens=False)
    assert ours.convert_ids_to_tokens(ids)[-4:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert ours.decode(ids) == "🦙"
    assert ours.bos_token_id == ours.encode("x")[0] == 1  # a SentencePiece vocab adds <s>
    assert ours.eos_token_ids == [2]


def test_control_tokens_stay_whole_and_are_skipped_on_decode(
        families: dict[str, tuple[Tokenizer, Any, Any]]) -> None:
    ours, _, _ = families["mistral"]
    ids = ours.encode("[INST] hi [/INST]", add_special_tokens=False)
    assert ids[0] == ours.token_to_id("[INST]") and ids[-1] == ours.token_to_id("[/INST]")
    assert ours.decode(ids) == "hi "  # the space before [/INST] is text; no prefix after [INST]
    assert ours.token_to_id("<tool>") in ours.encode("a <tool> b")


def test_no_space_prefix_when_the_file_says_so(tmp_path: Path) -> None:
    import sentencepiece

    proto = train_sentencepiece("llama2", add_dummy_prefix=False)
    path = write_vocab_gguf(tmp_path / "v.gguf", lambda w: add_sentencepiece_vocab(
        w, proto, add_space_prefix=False))
    ours = load_tokenizer(path)
    processor = sentencepiece.SentencePieceProcessor(model_proto=proto)
    for text in ("Hello world", "fox jumps", "code\n    x"):
        assert ours.encode(text, add_special_tokens=False) == processor.encode(text)
        assert ours.decode(processor.encode(text)) == text


def _byte_level_vocab(pre: str) -> Any:
    def add(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(["a", "b", "ab"])
        writer.add_token_types([1, 1, 1])
        writer.add_token_merges(["a b"])
    return add


def test_an_unknown_pre_tokenizer_is_refused_naming_it(tmp_path: Path) -> None:
    path = write_vocab_gguf(tmp_path / "v.gguf", _byte_level_vocab("mystery-bpe"))
    with pytest.raises(ValueError, match=r"pre-tokenizer 'mystery-bpe' \(tokenizer.ggml.pre\) "
                       r"is not supported.*supported: dbrx, .*, qwen2, smaug-bpe, smollm\)"):
        load_tokenizer(path)


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2"])
def test_known_pre_tokenizers_load(tmp_path: Path, pre: str) -> None:
    ours = load_tokenizer(write_vocab_gguf(tmp_path / "v.gguf", _byte_level_vocab(pre)))
    assert ours.encode("ab", add_special_tokens=False) == [2]


# ------------------------------------------------------------------ chat templates
@pytest.mark.parametrize("family", FAMILIES)
def test_the_gguf_chat_template_renders_as_transformers(
        families: dict[str, tuple[Tokenizer, Any, Any]], family: str) -> None:
    ours, theirs, _ = families[family]
    assert ours.chat_template == FAMILIES[family][2]
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=False) == \
        theirs.apply_chat_template(MESSAGES, tokenize=False)


def _write_template_files(folder: Path, files: tuple[str, ...]) -> None:
    if "config" in files:
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config"}))
    if "jinja" in files:
        (folder / "chat_template.jinja").write_text("jinja")


@pytest.mark.parametrize(("in_gguf", "files", "expected"), [
    ("gguf", ("config", "jinja"), "gguf"),
    (None, ("config", "jinja"), "jinja"),
    (None, ("config",), "config"),
    (None, (), None),
])
def test_chat_template_from_the_gguf_then_its_folder(
        tmp_path: Path, in_gguf: str | None, files: tuple[str, ...],
        expected: str | None) -> None:
    proto = train_sentencepiece("llama2")
    path = write_vocab_gguf(tmp_path / "v.gguf", lambda w: add_sentencepiece_vocab(w, proto),
                            chat_template=in_gguf)
    _write_template_files(tmp_path, files)
    assert load_tokenizer(path).chat_template == expected


@pytest.mark.parametrize(("files", "expected"), [(("config", "jinja"), "jinja"),
                                                 (("config",), "config")])
def test_a_folders_chat_template_jinja_comes_before_its_config(
        tmp_path: Path, files: tuple[str, ...], expected: str) -> None:
    """As transformers reads a folder: chat_template.jinja is its newer spelling."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import BPE

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    FastTokenizer(BPE()).save(str(folder / "tokenizer.json"))
    _write_template_files(folder, files)
    assert load_tokenizer(folder).chat_template == expected


# ------------------------------------------------------------------ the real server
@pytest.fixture(scope="module")
def mistral_gguf_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A tiny random Llama's weights with a Mistral-style SentencePiece vocabulary (its 420
    pieces fill the first rows of the model's 512), served."""
    from tests.frontend.conftest import tiny_server
    from tests.tiny_model import build_tiny_llama

    folder = build_tiny_llama(tmp_path_factory.mktemp("spm-llama") / "m")
    path = write_tiny_gguf(folder, folder.parent / "mistral.gguf",
                           sentencepiece=train_sentencepiece("mistral"),
                           chat_template=FAMILIES["mistral"][2])
    with tiny_server(path) as server:
        yield server


def test_a_sentencepiece_gguf_is_served(
        mistral_gguf_server: Any, families: dict[str, tuple[Tokenizer, Any, Any]]) -> None:
    _, theirs, _ = families["mistral"]
    text = "Hello, world! 🦙 [INST]"
    tokens = httpx.post(mistral_gguf_server.url("/tokenize"), timeout=30,
                        json={"model": "tiny", "prompt": text}).json()["tokens"]
    assert tokens == theirs.encode(text)
    chat = httpx.post(mistral_gguf_server.url("/tokenize"), timeout=30,
                      json={"model": "tiny", "messages": MESSAGES[:1]}).json()["tokens"]
    assert chat == theirs.apply_chat_template(MESSAGES[:1], tokenize=True,
                                              return_dict=False)
    response = httpx.post(mistral_gguf_server.url("/v1/chat/completions"), timeout=60, json={
        "model": "tiny", "messages": MESSAGES[:1], "max_tokens": 3, "temperature": 0,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(chat)
