"""A tiny random Llama as a real HF folder: config.json, model.safetensors, tokenizer.json
(a byte-level BPE trained here), tokenizer_config.json with a ChatML chat template, and
generation_config.json. Loads in well under a second, so end-to-end tests can start real
servers on it. Built with transformers (which imports torch: tests only, never the
gateway's front end)."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! This is a tiny model for tests.",
    "Summarize the following text in one sentence.",
    "Plugins extend the gateway through Python entry points.",
    "Once upon a time there was a server that answered every request.",
    "0123456789 + - * / = ( ) [ ] { } < > : ; ' \" , . ? !",
]


def build_tiny_llama(folder: Path, *, vocab_size: int = 512,
                     max_position_embeddings: int = 4096, seed: int = 0) -> Path:
    """Write the tiny model into `folder` (created) and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_vocab = _write_tokenizer(folder, vocab_size)
    _write_model(folder, tokenizer_vocab, max_position_embeddings, seed)
    return folder


def _write_tokenizer(folder: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS * 20, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "bos_token": None, "eos_token": "<|im_end|>",
        "clean_up_tokenization_spaces": False, "model_max_length": 4096,
    }))
    return int(tokenizer.get_vocab_size(with_added_tokens=True))


def _write_model(folder: Path, vocab_size: int, max_position_embeddings: int,
                 seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    eos_token_id = SPECIAL_TOKENS.index("<|im_end|>")
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        bos_token_id=None, eos_token_id=eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos_token_id}))
