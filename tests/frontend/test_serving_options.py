"""The server-wide OpenAI settings read at start-up: generation defaults from an HF
folder or GGUF metadata, and --chat-template as a file or inline."""

from __future__ import annotations

import json

import gguf
import pytest

from gateway.frontend.openai.serving import load_chat_template, read_generation_defaults


def test_gguf_sampling_metadata_gives_the_defaults(tmp_path):
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.5)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.25)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert read_generation_defaults(path, "auto") == {
        "temperature": 0.5, "top_k": 40, "repetition_penalty": 1.25}
    assert read_generation_defaults(path, "vllm") == {}


def test_the_default_model_gets_its_model_cards_defaults_and_vllm_turns_them_off(tmp_path):
    from gateway.models.info.paths import default_model_path

    path = default_model_path()
    assert read_generation_defaults(path, "auto") == {"temperature": 0.2, "top_p": 0.9}
    assert read_generation_defaults(path, "vllm") == {}
    other = tmp_path / "other.gguf"  # another GGUF without sampling metadata: none
    writer = gguf.GGUFWriter(str(other), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert read_generation_defaults(other, "auto") == {}


def test_only_numeric_sampling_keys_are_read_from_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": "0.9", "do_sample": True, "max_length": 20,
         "min_p": 0.05}))
    assert read_generation_defaults(tmp_path, "auto") == {"temperature": 0.7, "min_p": 0.05}


def test_a_folder_named_by_generation_config_is_read(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 7}))
    assert read_generation_defaults(tmp_path, str(other)) == {"top_k": 7}
    with pytest.raises(FileNotFoundError):
        read_generation_defaults(tmp_path, str(tmp_path / "missing"))


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert load_chat_template(str(tmp_path / "t.jinja")) == "{{ messages }}"
    assert load_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    assert load_chat_template(None) is None
    with pytest.raises(FileNotFoundError):
        load_chat_template(str(tmp_path / "nope.jinja"))
