"""The pooling runner behind a Worker on a tiny random BERT: the model's pooling method and
normalisation, per-request `normalize` and `dimensions`, an empty step, requests it cannot
embed answered in `errors` while the others run, no KV cache, and the dtype rule."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from gateway.config import EngineConfig, ModelConfig
from gateway.messages import NewRequestData, PoolingParams, SchedulerOutput
from gateway.platforms.cpu_isa import cpu_isa
from gateway.sampling_params import SamplingParams
from gateway.worker.pooling_runner import pool
from gateway.worker.worker import Worker
from tests.step_driver import pooled_vectors, pooling_step
from tests.tiny_model import build_tiny_bert

pytestmark = pytest.mark.isa  # the CPU's instruction set decides the paths

PROMPTS = {"a": [2, 15, 40, 41, 3], "b": [2, 7, 3], "c": [2] + list(range(10, 80)) + [3]}


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("models") / "tiny-bert")


def _worker(model: Path, dtype: str = "float32") -> Worker:
    worker = Worker(EngineConfig(model=ModelConfig(model=str(model), dtype=dtype)))
    worker.init_device()
    worker.load_model()
    return worker


@pytest.fixture(scope="module")
def worker(tiny_bert: Path) -> Worker:
    return _worker(tiny_bert)


@pytest.fixture(scope="module")
def hf_bert(tiny_bert: Path):  # type: ignore[no-untyped-def]
    from transformers import BertModel

    return BertModel.from_pretrained(str(tiny_bert), add_pooling_layer=False).eval()


def _hf_hidden(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' last hidden states [L, E] of one sequence."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def _unit(vector: np.ndarray) -> np.ndarray:
    return np.asarray(vector / np.linalg.norm(vector))


def test_the_model_default_normalises_and_a_request_can_turn_it_off(
        worker: Worker, hf_bert) -> None:  # type: ignore[no-untyped-def]
    raw_mean = _hf_hidden(hf_bert, PROMPTS["a"]).mean(0).numpy()
    default = pooled_vectors(pooling_step(worker, PROMPTS))["a"]
    off = pooled_vectors(pooling_step(worker, PROMPTS, PoolingParams(normalize=False)))["a"]
    on = pooled_vectors(pooling_step(worker, PROMPTS, PoolingParams(normalize=True)))["a"]
    assert np.allclose(off, raw_mean, atol=1e-5) and abs(np.linalg.norm(off) - 1) > 0.1
    assert np.allclose(default, _unit(raw_mean), atol=1e-5)
    assert np.array_equal(on, default)


def test_without_a_normalize_module_the_default_is_raw(hf_bert, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                       ) -> None:
    folder = build_tiny_bert(tmp_path / "raw", normalize=False)
    vector = pooled_vectors(pooling_step(_worker(folder), PROMPTS))["b"]
    assert np.allclose(vector, _hf_hidden(hf_bert, PROMPTS["b"]).mean(0).numpy(), atol=1e-5)


@pytest.mark.parametrize(("method", "expected"), [
    ("cls", lambda hidden: hidden[0]),
    ("lasttoken", lambda hidden: hidden[-1]),
    ("max", lambda hidden: hidden.max(0).values),
    ("mean", lambda hidden: hidden.mean(0)),
])
def test_the_pooling_method_comes_from_the_model_config(hf_bert, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                        method: str, expected) -> None:
    folder = build_tiny_bert(tmp_path / method, pooling=method, normalize=False)
    vectors = pooled_vectors(pooling_step(_worker(folder), PROMPTS))
    for req_id, ids in PROMPTS.items():
        reference = expected(_hf_hidden(hf_bert, ids)).numpy()
        assert np.allclose(vectors[req_id], reference, atol=1e-5), req_id


def test_pool_reduces_each_packed_sequence_alone() -> None:
    hidden = torch.tensor([[1.0, -1.0], [3.0, 5.0], [10.0, 0.0], [-2.0, 2.0], [4.0, 4.0]])
    lens = [2, 3]
    assert pool(hidden, lens, "mean").tolist() == [[2.0, 2.0], [4.0, 2.0]]
    assert pool(hidden, lens, "max").tolist() == [[3.0, 5.0], [10.0, 4.0]]
    assert pool(hidden, lens, "cls").tolist() == [[1.0, -1.0], [10.0, 0.0]]
    assert pool(hidden, lens, "lasttoken").tolist() == [[3.0, 5.0], [4.0, 4.0]]


def test_dimensions_keeps_the_first_values_then_normalises(worker: Worker) -> None:
    raw = pooled_vectors(pooling_step(worker, PROMPTS, PoolingParams(normalize=False)))["c"]
    cut = pooled_vectors(pooling_step(worker, PROMPTS, PoolingParams(
        dimensions=16, normalize=False)))["c"]
    cut_default = pooled_vectors(pooling_step(worker, PROMPTS, PoolingParams(dimensions=16)))["c"]
    assert cut.shape == cut_default.shape == (16,)
    assert np.array_equal(cut, raw[:16])
    assert np.allclose(cut_default, _unit(raw[:16]), atol=1e-6)


def test_requests_with_different_params_share_a_step(worker: Worker) -> None:
    params: dict[str, PoolingParams | None] = {
        "a": PoolingParams(normalize=False), "b": PoolingParams(dimensions=8),
        "c": PoolingParams()}
    mixed = pooled_vectors(pooling_step(worker, PROMPTS, params))
    for req_id, one in params.items():
        alone = pooled_vectors(pooling_step(worker, {req_id: PROMPTS[req_id]}, one))[req_id]
        assert np.allclose(mixed[req_id], alone, atol=1e-5)
    assert [len(mixed[r]) for r in "abc"] == [64, 8, 64]


def test_an_empty_step_returns_an_empty_output(worker: Worker) -> None:
    output = pooling_step(worker, {})
    assert (output.req_ids, output.sampled_token_ids, output.pooler_outputs,
            output.errors) == ([], [], {}, {})


def test_requests_it_cannot_embed_are_answered_in_errors_and_the_rest_run(
        worker: Worker) -> None:
    prompts = {"ok": PROMPTS["a"], "empty": [], "long": [5] * 257, "oov": [2, 10_000, 3],
               "wide": PROMPTS["b"], "generate": PROMPTS["b"]}
    params: dict[str, PoolingParams | None] = {
        "ok": PoolingParams(), "empty": PoolingParams(), "long": PoolingParams(),
        "oov": PoolingParams(), "wide": PoolingParams(dimensions=65), "generate": None}
    output = pooling_step(worker, prompts, params)
    assert list(output.pooler_outputs) == ["ok"]
    assert output.req_ids == [] and output.sampled_token_ids == []
    assert "empty" in output.errors["empty"]
    assert "257 tokens, more than the model's 256" in output.errors["long"]
    assert "outside the vocabulary" in output.errors["oov"]
    assert "dimensions 65 must be between 1 and the model's 64" in output.errors["wide"]
    assert ("supports the tasks 'embed'; the request asks for generation"
            in output.errors["generate"])


def test_a_prompt_not_scheduled_whole_is_an_error(worker: Worker) -> None:
    new = NewRequestData(req_id="a", prompt_token_ids=PROMPTS["a"],
                         sampling_params=SamplingParams(), block_ids=[],
                         pooling_params=PoolingParams())
    with pytest.raises(ValueError, match="whole prompt"):
        worker.execute_model(SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=[],
                                             num_scheduled_tokens={"a": 2}, finished_req_ids=[]))


def test_steps_keep_no_state_so_an_id_can_come_back(worker: Worker) -> None:
    first = pooled_vectors(pooling_step(worker, {"x": PROMPTS["a"]}))["x"]
    second = pooled_vectors(pooling_step(worker, {"x": PROMPTS["b"]}))["x"]
    third = pooled_vectors(pooling_step(worker, {"x": PROMPTS["a"]}))["x"]
    assert not np.allclose(first, second) and np.array_equal(first, third)


def test_an_encoder_allocates_no_kv_cache(worker: Worker, caplog: pytest.LogCaptureFixture,
                                          ) -> None:
    with caplog.at_level("INFO", logger="gateway"):
        assert worker.initialize_kv_cache() == 0
    assert "KV cache: none" in caplog.text
    assert worker.supported_tasks == ("embed",)


def test_auto_dtype_keeps_float32_for_an_embedding_model(tiny_bert: Path) -> None:
    assert _worker(tiny_bert, dtype="auto").dtype == torch.float32


def test_auto_dtype_follows_the_platform_for_a_half_precision_checkpoint(
        tiny_bert: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_bert, tmp_path / "bf16")
    config = json.loads((folder / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    worker = Worker(EngineConfig(model=ModelConfig(model=str(folder), dtype="auto")))
    worker.init_device()
    expected = torch.bfloat16 if cpu_isa().has_native_bf16 else torch.float32
    assert worker.dtype == expected


def test_an_explicit_bfloat16_is_honoured_and_close_to_float32(worker: Worker,
                                                              tiny_bert: Path) -> None:
    bf16 = _worker(tiny_bert, dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    ours = pooled_vectors(pooling_step(bf16, PROMPTS))
    reference = pooled_vectors(pooling_step(worker, PROMPTS))
    for req_id in PROMPTS:
        assert ours[req_id].dtype == np.float32  # pooled in float32 whatever the model's dtype
        assert float(ours[req_id] @ reference[req_id]) > 0.99
