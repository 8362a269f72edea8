"""The output items of a `/v1/responses` answer (front end): `reasoning`, `message` and
`function_call` items, built from the chat answer's deltas (chat_output.MessageStream),
with the stream events that announce them in the Responses API's order. The whole answer
is the same text fed at once, so a streamed response ends with exactly the items a
non-streamed one holds.
"""

from __future__ import annotations

import uuid
from typing import Any

from gateway.frontend.openai.chat_output import MessageStream


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """One answer's output items; `feed` and `finish` return the events (dicts with their
    `type`, without `sequence_number`) of what they added."""

    def __init__(self, stream: MessageStream) -> None:
        self.stream = stream
        self.items: list[dict[str, Any]] = []
        self.reasoning = ""  # all of the reasoning text
        self._open: dict[str, Any] | None = None  # the item being written
        self._open_text = ""  # its text so far (message or reasoning)
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self._blank = ""  # whitespace content held back: it may precede a tool call
        self._logprobs: list[dict[str, Any]] = []  # of tokens not yet on an event
        self._open_logprobs: list[dict[str, Any]] = []  # on the open message's text

    def add_logprobs(self, entries: list[dict[str, Any]]) -> None:
        """Log-probabilities of the next tokens (chat's shape): they go with the message
        text sent next (every generated token's, reasoning and call text included)."""
        self._logprobs += entries

    def feed(self, delta_text: str, is_final: bool) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in self.stream.feed(delta_text, is_final):
            if delta.get("reasoning_content"):
                self._add_reasoning(delta["reasoning_content"], events)
            if delta.get("content"):
                self._add_content(delta["content"], events)
            for call in delta.get("tool_calls", []):
                self._add_call(call, events)
        return events

    def finish(self, *, is_truncated: bool) -> list[dict[str, Any]]:
        """Close the last item (status `incomplete` when the answer was cut short); an
        answer with no item at all, or only blank text, is one message."""
        events: list[dict[str, Any]] = []
        if not self._calls and (self._blank or not self.items):
            self._open_message(events)
            self._text_delta(self._blank, events)
        self._close(events, status="incomplete" if is_truncated else "completed")
        return events

    # -- reasoning
    def _add_reasoning(self, text: str, events: list[dict[str, Any]]) -> None:
        if self._open is None or self._open["type"] != "reasoning":
            self._close(events)
            self._start({"id": item_id("rs"), "type": "reasoning", "summary": [],
                         "content": [], "status": "in_progress"}, events)
            events.append(self._part_event("response.content_part.added",
                                           {"type": "reasoning_text", "text": ""}))
        self.reasoning += text
        self._open_text += text
        events.append({"type": "response.reasoning_text.delta", **self._where(),
                       "content_index": 0, "delta": text})

    # -- message text
    def _add_content(self, text: str, events: list[dict[str, Any]]) -> None:
        if self._open is None or self._open["type"] != "message":
            if not (self._blank + text).strip():
                self._blank += text
                return
            self._open_message(events)
        self._text_delta(self._blank + text, events)
        self._blank = ""

    def _open_message(self, events: list[dict[str, Any]]) -> None:
        self._close(events)
        self._start({"id": item_id("msg"), "type": "message", "role": "assistant",
                     "status": "in_progress", "content": []}, events)
        events.append(self._part_event("response.content_part.added", _text_part("")))

    def _text_delta(self, text: str, events: list[dict[str, Any]]) -> None:
        if text:
            self._open_text += text
            logprobs, self._logprobs = self._logprobs, []
            self._open_logprobs += logprobs
            events.append({"type": "response.output_text.delta", **self._where(),
                           "content_index": 0, "delta": text, "logprobs": logprobs})

    # -- function calls
    def _add_call(self, call: dict[str, Any], events: list[dict[str, Any]]) -> None:
        function = call.get("function", {})
        if "id" in call:  # a new call starts
            self._close(events)
            self._blank = ""
            item = {"id": item_id("fc"), "type": "function_call", "call_id": call["id"],
                    "name": function["name"], "arguments": "", "status": "in_progress"}
            self._calls[call["index"]] = item
            self._start(item, events)
        pieces = function.get("arguments") or ""
        item = self._calls[call["index"]]
        if pieces:
            item["arguments"] += pieces
            events.append({"type": "response.function_call_arguments.delta",
                           "item_id": item["id"], "output_index": self.items.index(item),
                           "delta": pieces})

    # -- items
    def _start(self, item: dict[str, Any], events: list[dict[str, Any]]) -> None:
        self.items.append(item)
        self._open, self._open_text = item, ""
        events.append({"type": "response.output_item.added",
                       "output_index": len(self.items) - 1, "item": dict(item)})

    def _close(self, events: list[dict[str, Any]], status: str = "completed") -> None:
        item = self._open
        if item is None:
            return
        where, text = self._where(), self._open_text
        if item["type"] == "message":
            logprobs = self._open_logprobs + self._logprobs
            self._open_logprobs, self._logprobs = [], []
            part = _text_part(text, logprobs)
            events.append({"type": "response.output_text.done", **where, "content_index": 0,
                           "text": text, "logprobs": logprobs})
            events.append(self._part_event("response.content_part.done", part))
            item["content"] = [part]
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            events.append({"type": "response.reasoning_text.done", **where,
                           "content_index": 0, "text": text})
            events.append(self._part_event("response.content_part.done", part))
            item["content"] = [part]
        else:
            events.append({"type": "response.function_call_arguments.done", **where,
                           "name": item["name"], "arguments": item["arguments"]})
        item["status"] = status
        events.append({"type": "response.output_item.done",
                       "output_index": where["output_index"], "item": dict(item)})
        self._open = None

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _part_event(self, kind: str, part: dict[str, Any]) -> dict[str, Any]:
        return {"type": kind, **self._where(), "content_index": 0, "part": part}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": logprobs or []}
