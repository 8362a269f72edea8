"""Fast JSON responses (API-server process): msgspec encodes plain dicts (no pydantic round
trip on the way out).
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response


class JSONResponse(Response):
    """A JSON response encoded with msgspec."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)
