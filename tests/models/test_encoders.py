"""RoBERTa, XLM-R and the sequence classifiers against transformers on tiny random models:
hidden states of packed sequences (RoBERTa's positions counted from pad_token_id + 1),
classifier logits and their activations through a worker step (BERT pairs with token
types), the tasks each model has, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gateway.config import EngineConfig, ModelConfig
from gateway.messages import PoolingParams
from gateway.models.info.paths import read_model_info
from gateway.models.loading.loader import load_model
from gateway.tokenizer import load_tokenizer
from gateway.worker.worker import Worker
from tests.step_driver import pooled_vectors, pooling_step
from tests.tiny_model import build_tiny_encoder

PAIRS = [("what is a fox?", "the quick brown fox jumps over the lazy dog."),
         ("hello", "hello, world! this is a tiny model for tests."),
         ("plugins extend the gateway", "once upon a time there was a server")]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("encoders")
    cache: dict[tuple[str, int], Path] = {}

    def build(architecture: str, num_labels: int = 2) -> Path:
        key = (architecture, num_labels)
        if key not in cache:
            cache[key] = build_tiny_encoder(root / f"{architecture}-{num_labels}", architecture,
                                            num_labels=num_labels)
        return cache[key]
    return build


def _worker(folder: Path) -> Worker:
    worker = Worker(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32")))
    worker.init_device()
    worker.load_model()
    return worker


def _hf(folder: Path):  # type: ignore[no-untyped-def]
    import transformers

    config = json.loads((folder / "config.json").read_text())
    model_cls = getattr(transformers, config["architectures"][0])
    return model_cls.from_pretrained(str(folder)).eval()


@pytest.mark.parametrize("architecture", ["RobertaModel", "XLMRobertaModel"])
def test_roberta_packed_sequences_equal_transformers_one_by_one(models, architecture: str) -> None:
    folder = models(architecture)
    info = read_model_info(folder)
    assert info.supported_tasks == ("embed",)
    assert info.max_model_len == info.hf_config["max_position_embeddings"] - 2  # 2 = pad + 1
    generator = torch.Generator().manual_seed(0)
    lens = [3, 40, 128, 9, 70, 1]  # the longest uses the last position there is
    token_ids = [torch.randint(5, 300, (n,), generator=generator).tolist() for n in lens]
    model = load_model(info, torch.device("cpu"), torch.float32)
    positions = torch.cat([torch.arange(n) for n in lens])
    reference = _hf(folder)
    with torch.inference_mode():
        ours = model(torch.tensor(sum(token_ids, [])), positions, lens).split(lens)
        for mine, ids in zip(ours, token_ids, strict=True):
            theirs = reference(input_ids=torch.tensor([ids])).last_hidden_state[0]
            assert (mine - theirs).abs().max() < 1e-4


def _pair_inputs(folder: Path) -> list[tuple[list[int], int | None]]:
    """Each pair as our front end sends it: token ids and where token type 1 begins."""
    tokenizer = load_tokenizer(folder).tokenizer
    inputs = []
    for first, second in PAIRS:
        encoding = tokenizer.encode(first, second)
        start = encoding.type_ids.index(1) if 1 in encoding.type_ids else None
        inputs.append((encoding.ids, start))
    return inputs


def _reference_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    batch = tokenizer([p[0] for p in PAIRS], [p[1] for p in PAIRS], padding=True,
                      return_tensors="pt")
    with torch.inference_mode():
        return _hf(folder)(**batch).logits  # [S, C]


@pytest.mark.parametrize(("architecture", "num_labels", "tasks"), [
    ("BertForSequenceClassification", 1, ("classify", "score")),  # token types for pairs
    ("RobertaForSequenceClassification", 3, ("classify",)),
    ("XLMRobertaForSequenceClassification", 1, ("classify", "score")),
])
def test_classifier_outputs_equal_transformers_with_activations(models, architecture: str,
                                                                num_labels: int,
                                                                tasks: tuple[str, ...]) -> None:
    folder = models(architecture, num_labels)
    worker = _worker(folder)
    assert worker.supported_tasks == tasks == read_model_info(folder).supported_tasks
    inputs = _pair_inputs(folder)
    assert (inputs[0][1] is not None) == architecture.startswith("Bert")
    prompts, params = {}, {}
    for i, (ids, start) in enumerate(inputs):
        for task in tasks:
            for use_activation in (None, False):
                req_id = f"{i}-{task}-{use_activation}"
                prompts[req_id] = ids
                params[req_id] = PoolingParams(task=task, use_activation=use_activation,
                                               second_segment_start=start)
    output = pooling_step(worker, prompts, params)
    assert not output.errors
    vectors = pooled_vectors(output)
    logits = _reference_logits(folder)
    activated = torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, -1)
    for i in range(len(PAIRS)):
        for task in tasks:
            assert vectors[f"{i}-{task}-None"] == pytest.approx(activated[i].tolist(), abs=1e-5)
            assert vectors[f"{i}-{task}-False"] == pytest.approx(logits[i].tolist(), abs=1e-4)


def test_bert_token_types_change_the_score(models) -> None:
    worker = _worker(models("BertForSequenceClassification", 1))
    ids, start = _pair_inputs(models("BertForSequenceClassification", 1))[0]
    output = pooled_vectors(pooling_step(worker, {"pair": ids, "flat": ids}, {
        "pair": PoolingParams(task="score", second_segment_start=start, use_activation=False),
        "flat": PoolingParams(task="score", use_activation=False)}))
    assert abs(float(output["pair"][0]) - float(output["flat"][0])) > 1e-3  # tolerance: 1e-4


@pytest.mark.parametrize(("fields", "expected"), [
    ({"problem_type": "regression"}, "identity"),
    ({"problem_type": "multi_label_classification"}, "sigmoid"),
    ({}, "softmax"),
])
def test_the_classify_activation_follows_the_problem_type(models, tmp_path: Path, fields,
                                                          expected: str) -> None:
    folder = shutil.copytree(models("RobertaForSequenceClassification", 3), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    worker = _worker(folder)
    ids = _pair_inputs(folder)[0][0]
    out = pooled_vectors(pooling_step(worker, {"raw": ids, "act": ids}, {
        "raw": PoolingParams(task="classify", use_activation=False),
        "act": PoolingParams(task="classify")}))
    raw = torch.tensor(out["raw"])
    want = {"identity": raw, "sigmoid": torch.sigmoid(raw), "softmax": torch.softmax(raw, 0)}
    assert out["act"] == pytest.approx(want[expected].tolist(), abs=1e-6)


@pytest.mark.parametrize(("activation_fn", "error"), [
    ("torch.nn.modules.linear.Identity", None),
    ("torch.nn.modules.activation.Tanh", "cross-encoder activation"),
    ("os.system", "cross-encoder activation"),
])
def test_a_cross_encoder_names_its_score_activation(models, tmp_path: Path, activation_fn: str,
                                                    error: str | None) -> None:
    folder = shutil.copytree(models("BertForSequenceClassification", 1), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": activation_fn}
    (folder / "config.json").write_text(json.dumps(config))
    if error is not None:
        with pytest.raises(ValueError, match=error):
            _worker(folder)
        return
    ids = _pair_inputs(folder)[0][0]
    out = pooled_vectors(pooling_step(_worker(folder), {"raw": ids, "score": ids}, {
        "raw": PoolingParams(task="score", use_activation=False),
        "score": PoolingParams(task="score")}))
    assert out["score"] == pytest.approx(out["raw"].tolist(), abs=0)


@pytest.mark.parametrize(("architecture", "num_labels", "params", "error"), [
    ("RobertaModel", 2, PoolingParams(task="classify"), "supports the tasks 'embed'"),
    ("RobertaForSequenceClassification", 3, PoolingParams(task="score"),
     "supports the tasks 'classify'"),
    ("RobertaForSequenceClassification", 3, PoolingParams(task="embed"), "asks for 'embed'"),
    ("XLMRobertaForSequenceClassification", 1,
     PoolingParams(task="score", second_segment_start=2), "needs a model with token types"),
    ("BertForSequenceClassification", 1,
     PoolingParams(task="score", second_segment_start=9), "inside the input of 5 tokens"),
])
def test_a_request_the_model_cannot_pool_is_answered_alone(models, architecture: str,
                                                           num_labels: int,
                                                           params: PoolingParams,
                                                           error: str) -> None:
    worker = _worker(models(architecture, num_labels))
    ok = PoolingParams(task=worker.supported_tasks[0])
    output = pooling_step(worker, {"bad": [0, 10, 11, 12, 2], "ok": [0, 10, 2]},
                          {"bad": params, "ok": ok})
    assert error in output.errors["bad"]
    assert set(output.pooler_outputs) == {"ok"}


def test_a_classifier_checkpoint_needs_its_head(models, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(models("RobertaForSequenceClassification", 3), tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("classifier.out_proj.")},
              folder / "model.safetensors")
    with pytest.raises(ValueError, match="lacks tensor 'classifier.out_proj"):
        load_model(read_model_info(folder), torch.device("cpu"), torch.float32)


ENCODER_ARCHITECTURES = ["BertModel", "RobertaModel", "XLMRobertaModel",
                         "BertForSequenceClassification", "RobertaForSequenceClassification",
                         "XLMRobertaForSequenceClassification"]


def test_every_encoder_architecture_is_registered_and_documented() -> None:
    from gateway.models.info.registry import ModelRegistry

    doc = (Path(__file__).resolve().parents[2] / "docs" / "embeddings-and-scoring.md").read_text()
    for architecture in ENCODER_ARCHITECTURES:
        assert ModelRegistry.is_registered(architecture)
        assert f"`{architecture}`" in doc, architecture
