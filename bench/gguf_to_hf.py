"""Convert a llama-family GGUF file into an HF folder (config.json, float32 safetensors,
tokenizer.json and tokenizer_config.json), dequantizing with the gateway's own loader, so a
server that cannot read the GGUF's quantized types (vLLM with Q4_1) serves the same weights.

    python bench/gguf_to_hf.py MODEL.gguf OUT_FOLDER
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from bench.tokenizer_files import write_tokenizer_files
from gateway.models.info.gguf_file import GGUFFile
from gateway.models.info.paths import gguf_hf_config
from gateway.models.loading.gguf_weights import iter_gguf_weights


def convert(path: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    gguf = GGUFFile(path)
    config = gguf_hf_config(gguf)
    config.setdefault("torch_dtype", "float32")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {}
    for name, _, array in iter_gguf_weights(gguf):  # float32 arrays: nothing kept quantized
        assert isinstance(array, np.ndarray)
        tensors[name] = array.copy()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(path, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(convert(args.gguf, args.out))


if __name__ == "__main__":
    main()
