"""BertModel: embeddings equal transformers' AutoModel + the model's pooling, on the real
all-MiniLM-L6-v2 (a worker step of mixed lengths, and one sentence per step) and on a tiny
random BERT (hidden states of packed sequences in several attention groups); checkpoint
names with or without "bert."; a missing tensor is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from gateway.config import EngineConfig, ModelConfig
from gateway.models.archs.bert import attention_groups
from gateway.models.info.paths import read_model_info
from gateway.models.loading.loader import load_model
from gateway.tokenizer import load_tokenizer
from gateway.worker.worker import Worker
from tests.step_driver import pooled_vectors, pooling_step
from tests.tiny_model import build_tiny_bert

SENTENCES = [
    "Hello!",
    "The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé: accents, Ωμέγα, 日本語 and emoji 🤖 in one sentence.",
    "Embeddings map sentences with similar meaning to nearby vectors.",
    "A long document about serving models. " * 40,  # ~280 tokens: its own attention group
    "short",
    "Plugins extend the gateway through Python entry points, loaded in every process.",
]


def _worker(model: str | Path, dtype: str = "auto") -> Worker:
    worker = Worker(EngineConfig(model=ModelConfig(model=str(model), dtype=dtype)))
    worker.init_device()
    worker.load_model()
    return worker


def _reference_embeddings(folder: Path, token_ids: list[list[int]]) -> np.ndarray:
    """transformers' AutoModel on one padded batch, mean-pooled over the attention mask and
    L2-normalised: what sentence-transformers' encode computes for MiniLM."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    longest = max(len(ids) for ids in token_ids)
    input_ids = torch.tensor([ids + [0] * (longest - len(ids)) for ids in token_ids])
    mask = torch.tensor([[1] * len(ids) + [0] * (longest - len(ids)) for ids in token_ids])
    with torch.inference_mode():
        hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def _cosine_distances(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    cosine = (ours * theirs).sum(-1) / (np.linalg.norm(ours, axis=-1)
                                         * np.linalg.norm(theirs, axis=-1))
    return np.asarray(1 - cosine)


@pytest.mark.e2e
def test_minilm_embeddings_equal_transformers_batched_and_one_at_a_time() -> None:
    worker = _worker("all-MiniLM-L6-v2")
    assert worker.dtype == torch.float32  # "auto" keeps the float32 checkpoint's dtype
    tokenizer = load_tokenizer("all-MiniLM-L6-v2")
    token_ids = [tokenizer.encode(text) for text in SENTENCES]
    assert len(token_ids[4]) > 256 and len(token_ids[2]) < 64  # two attention groups
    batched = pooled_vectors(pooling_step(worker, {str(i): ids for i, ids in
                                                   enumerate(token_ids)}))
    alone = [pooled_vectors(pooling_step(worker, {"x": ids}))["x"] for ids in token_ids]
    reference = _reference_embeddings(worker._require_info().path, token_ids)
    ours = np.stack([batched[str(i)] for i in range(len(token_ids))])
    assert ours.shape == (len(SENTENCES), 384)
    assert np.allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)  # Normalize module
    assert _cosine_distances(ours, reference).max() < 1e-4
    assert _cosine_distances(np.stack(alone), reference).max() < 1e-4


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("models") / "tiny-bert")


def _hf_hidden_states(folder: Path, token_ids: list[list[int]]) -> list[torch.Tensor]:
    from transformers import BertModel

    model = BertModel.from_pretrained(str(folder), add_pooling_layer=False).eval()
    with torch.inference_mode():
        return [model(input_ids=torch.tensor([ids])).last_hidden_state[0] for ids in token_ids]


def _our_hidden_states(folder: Path, token_ids: list[list[int]]) -> list[torch.Tensor]:
    model = load_model(read_model_info(folder), torch.device("cpu"), torch.float32)
    lens = [len(ids) for ids in token_ids]
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        hidden = model(torch.tensor([t for ids in token_ids for t in ids]), positions, lens)
    return list(hidden.split(lens))


def test_packed_sequences_equal_transformers_one_by_one(tiny_bert: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    lens = [3, 40, 150, 9, 70, 1, 256]  # attention groups (3, 40) (150, 9) (70, 1) (256)
    token_ids = [torch.randint(5, 180, (n,), generator=generator).tolist() for n in lens]
    ours = _our_hidden_states(tiny_bert, token_ids)
    theirs = _hf_hidden_states(tiny_bert, token_ids)
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.shape == reference.shape
        assert (mine - reference).abs().max() < 1e-4


@pytest.mark.parametrize(("lens", "group_sizes"), [
    ([5, 30, 64], [3]),  # short sequences share one group whatever their lengths
    ([5, 30, 64, 65, 200, 130], [3, 1, 2]),  # 65 > 2 x 5; 200 > 2 x 65; 130 <= 2 x 130
    ([100, 100, 100], [3]),
    ([7], [1]),
])
def test_attention_groups_hold_sequences_of_similar_length(lens: list[int],
                                                           group_sizes: list[int]) -> None:
    groups = attention_groups(lens, torch.device("cpu"))
    assert [g.num_seqs for g in groups] == group_sizes
    assert [g.first_token for g in groups] == np.cumsum([0] + [g.num_tokens for g in groups])[
        :-1].tolist()
    assert sum(g.num_tokens for g in groups) == sum(lens)
    for group in groups:
        is_padded = group.pad_index is not None
        assert is_padded == (group.num_seqs * group.max_len > group.num_tokens)


def _rewrite_checkpoint(source: Path, target: Path, rename) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    save_file({new: t for name, t in tensors.items() if (new := rename(name)) is not None},
              target / "model.safetensors")
    return target


def test_a_bert_prefixed_checkpoint_with_tensorflow_norm_names_loads_alike(
        tiny_bert: Path, tmp_path: Path) -> None:
    def rename(name: str) -> str:
        name = name.replace("LayerNorm.weight", "LayerNorm.gamma")
        return "bert." + name.replace("LayerNorm.bias", "LayerNorm.beta")

    prefixed = _rewrite_checkpoint(tiny_bert, tmp_path / "prefixed", rename)
    extra = load_file(prefixed / "model.safetensors")
    extra["cls.predictions.bias"] = torch.zeros(3)  # a task head the encoder does not use
    save_file(extra, prefixed / "model.safetensors")
    token_ids = [[2, 10, 20, 30, 3], [2, 7, 3]]
    for mine, reference in zip(_our_hidden_states(prefixed, token_ids),
                               _our_hidden_states(tiny_bert, token_ids), strict=True):
        assert torch.equal(mine, reference)


def test_a_missing_tensor_is_an_error_naming_it(tiny_bert: Path, tmp_path: Path) -> None:
    missing = "encoder.layer.1.output.dense.weight"
    broken = _rewrite_checkpoint(tiny_bert, tmp_path / "broken",
                                 lambda name: None if name == missing else name)
    with pytest.raises(ValueError, match=f"lacks tensor '{missing}' needed by BertModel"):
        load_model(read_model_info(broken), torch.device("cpu"), torch.float32)


def test_an_unsupported_position_embedding_type_is_refused(tiny_bert: Path,
                                                           tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_bert, tmp_path / "relative")
    config = json.loads((folder / "config.json").read_text())
    config["position_embedding_type"] = "relative_key"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key'"):
        load_model(read_model_info(folder), torch.device("cpu"), torch.float32)
