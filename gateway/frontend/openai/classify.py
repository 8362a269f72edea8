"""POST /classify (task `classify`): text or token ids in, each input's class probabilities
out, with the most likely class's label (vLLM's route and shapes).

Each input is one engine request; the worker runs the classification head and, unless the
request sets `use_activation` false, the model's activation (softmax over several labels,
sigmoid for one), so `probs` are what transformers' logits give through it.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.frontend.http.json_body import JSONBodyRoute
from gateway.frontend.http.responses import JSONResponse
from gateway.frontend.openai.embeddings import input_token_ids, pool, usage
from gateway.frontend.openai.ignored_fields import report_ignored
from gateway.frontend.openai.sampling import check_model
from gateway.frontend.openai.score_protocol import ClassificationRequest
from gateway.frontend.server_state import server_state
from gateway.plugins import EngineClient
from gateway.pooling_params import PoolingParams

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/classify")
async def create_classify(body: ClassificationRequest, request: Request) -> Response:
    """vLLM's classification API."""
    engine_client = server_state(request).engine_client
    check_model(body.model, engine_client.model_name)
    body.check_priority()
    prompts = input_token_ids(body.input, engine_client, body.truncate_prompt_tokens,
                              body.add_special_tokens)
    request_id = f"classify-{uuid.uuid4().hex}"
    params = PoolingParams(task="classify", use_activation=body.resolved_activation())
    outputs = await pool(engine_client, request, prompts, params, request_id)
    labels = _labels(engine_client)
    data = []
    for index, output in enumerate(outputs):
        probs = output.outputs.data.tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": index, "label": labels.get(str(best)), "probs": probs,
                     "num_classes": len(probs)})
    return report_ignored(body, JSONResponse({
        "id": request_id, "object": "list", "created": int(time.time()),
        "model": engine_client.model_name, "data": data,
        "usage": {**usage(prompts), "completion_tokens": 0, "prompt_tokens_details": None},
    }), "/classify")


def _labels(engine_client: EngineClient) -> dict[str, str]:
    """The config's id2label ({"0": "negative", ...}); none: no label names."""
    info = engine_client.model_info
    labels = (info.hf_config if info is not None else {}).get("id2label") or {}
    return {str(k): str(v) for k, v in labels.items()}
