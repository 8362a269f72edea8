"""A model's tokenizer, as the gateway reads it, written as HF tokenizer files
(tokenizer.json, tokenizer_config.json with the chat template): for HF folders made from a
GGUF (gguf_to_hf.py) or beside random weights (bench_gpu.py). Torch-free."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.tokenizer import load_tokenizer


def write_tokenizer_files(model: Path | None, out: Path) -> Path:
    """The tokenizer of `model` (a GGUF file or HF folder; None: the default model) into the
    folder `out` (made if missing); returns `out`."""
    tokenizer = load_tokenizer(model)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
         "chat_template": tokenizer.chat_template,
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
    return out
