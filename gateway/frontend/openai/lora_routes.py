"""/v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and answers), attached
only while VLLM_ALLOW_RUNTIME_LORA_UPDATING is true (API-server process). The adapters
themselves: lora.py.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import PlainTextResponse, Response

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.http.json_body import JSONBodyRoute
from gateway.frontend.prompt_work import off_loop
from gateway.frontend.server_state import server_state
from gateway.logger import init_logger
from gateway.models.info.lora_adapter import AdapterError

logger = init_logger(__name__)

router = APIRouter(route_class=JSONBodyRoute)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
    """Serve the adapter in folder `lora_path` as model `lora_name` (checked first: 400
    naming it and why)."""
    adapters = server_state(request).lora_adapters
    if body.lora_name in adapters.adapters:
        raise OpenAIError(400, f"The lora adapter '{body.lora_name}' has already been "
                          "loaded.", param="lora_name")
    try:
        await off_loop(adapters.add, body.lora_name, body.lora_path)
    except AdapterError as exc:
        raise OpenAIError(400, str(exc), param="lora_path") from None
    logger.info("Loaded LoRA adapter %r from %s.", body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
    """Stop serving the adapter `lora_name` (404 when none has that name). Requests
    already running keep it to their end."""
    if not server_state(request).lora_adapters.remove(body.lora_name):
        raise OpenAIError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                          param="lora_name", code="model_not_found")
    logger.info("Unloaded LoRA adapter %r.", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                             "successfully.")
