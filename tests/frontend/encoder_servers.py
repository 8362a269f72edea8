"""Helpers of the encoder end-to-end modules (classify, score, encoder embeddings): a real
`gateway serve` of a tiny random encoder, with three endpoint plugins installed, each
gated on one pooling task, so a module can check which of them attach; and the
transformers reference on the same folder."""

from __future__ import annotations

from pathlib import Path

import torch

from gateway.plugins import ENDPOINT_PLUGINS_GROUP
from tests.plugin_dists import subprocess_env, write_dist
from tests.server import ServerProcess

SERVED_NAME = "tiny-encoder"
TASK_PLUGINS = {"needs_embed": "embed", "needs_classify": "classify", "needs_score": "score"}
_MODULE = "gw_test_task_plugins"
_SOURCE = '''
from fastapi import APIRouter


class TaskPlugin:
    def __init__(self, task):
        self.name, self.required_tasks = f"needs_{task}", (task,)
        self.path = f"/v1/{task}-plugin"

    def attach_router(self, app):
        router = APIRouter()
        router.add_api_route(self.path, lambda: {"plugin": self.name}, methods=["GET"])
        app.include_router(router)

    async def init_state(self, engine_client, state, args):
        pass


def needs_embed():
    return TaskPlugin("embed")


def needs_classify():
    return TaskPlugin("classify")


def needs_score():
    return TaskPlugin("score")
'''


def encoder_server(model: Path, site: Path, log_path: Path) -> ServerProcess:
    """A (not yet started) server of `model` that may load the three task plugins."""
    write_dist(site, "gw-test-task-plugins",
               {ENDPOINT_PLUGINS_GROUP: {name: f"{_MODULE}:{name}" for name in TASK_PLUGINS}},
               {_MODULE: _SOURCE})
    env = subprocess_env(site, VLLM_PLUGINS=",".join(TASK_PLUGINS))
    env.pop("VLLM_API_KEY", None)
    return ServerProcess([str(model), "--served-model-name", SERVED_NAME,
                          "--disable-uvicorn-access-log"], env=env, log_path=log_path)


def attached_task_plugins(http) -> set[str]:  # type: ignore[no-untyped-def]
    """The tasks whose plugin route answers on the server."""
    return {task for task in TASK_PLUGINS.values()
            if http.get(f"/v1/{task}-plugin").status_code == 200}


def reference_logits(folder: Path, texts: list[str], pairs: list[str] | None = None,
                     **tokenizer_args: object) -> tuple[torch.Tensor, list[int]]:
    """transformers' AutoModelForSequenceClassification logits [S, C] of `texts` (or of
    the pairs (texts[i], pairs[i])), and each input's token count."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    batch = tokenizer(texts, pairs, padding=True, return_tensors="pt", **tokenizer_args)
    with torch.inference_mode():
        logits = model(**batch).logits
    return logits, batch["attention_mask"].sum(1).tolist()
