"""Request models of /classify, /score and /rerank (vLLM's fields; pydantic, validated by
FastAPI in the API-server process). Each is strict and keeps unknown fields aside for
X-Ignored-Fields, as every request model in protocol.py does."""

from __future__ import annotations

from gateway.frontend.http.errors import OpenAIError
from gateway.frontend.openai.protocol import OpenAIBaseModel

Texts = str | list[str]


class ActivationFields(OpenAIBaseModel):
    """What /classify, /score and /rerank share (vLLM's pooling extras)."""

    model: str | None = None
    user: str | None = None
    #: Longer inputs are cut to this many tokens (-1: the model's limit) instead of refused.
    truncate_prompt_tokens: int | None = None
    #: Apply the model's activation (softmax, sigmoid) to its logits; None: yes.
    use_activation: bool | None = None
    # vLLM's older names for use_activation, still accepted there.
    activation: bool | None = None
    softmax: bool | None = None
    #: Refused unless 0: this server has no priority scheduling (as vLLM without it).
    priority: int = 0

    def resolved_activation(self) -> bool | None:
        """use_activation, else its older names (vLLM's precedence)."""
        for value in (self.use_activation, self.activation, self.softmax):
            if value is not None:
                return value
        return None

    def check_priority(self) -> None:
        if self.priority != 0:
            raise OpenAIError(400, "priority must be 0: this server does not schedule by "
                              "priority.", param="priority")


class ClassificationRequest(ActivationFields):
    """POST /classify."""

    #: A string, a list of strings, a list of token ids, or a list of token-id lists.
    input: str | list[str] | list[int] | list[list[int]]
    add_special_tokens: bool = True


class ScoreRequest(ActivationFields):
    """POST /score (and /v1/score): pairs from `text_1` and `text_2` (1:1, 1:N or N:N);
    vLLM's newer names `queries`/`documents` and `data_1`/`data_2` are taken too."""

    text_1: Texts | None = None
    text_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None

    def pairs(self) -> tuple[list[str], list[str], str]:
        """(firsts, seconds, name of the first field), the single first text repeated
        for each second one; a 400 names a wrong shape."""
        given = [(a, b) for a, b in (("text_1", "text_2"), ("queries", "documents"),
                                      ("data_1", "data_2"))
                 if getattr(self, a) is not None or getattr(self, b) is not None]
        if len(given) != 1:
            raise OpenAIError(400, "Give the texts to score as `text_1` and `text_2` (or "
                              "`queries` and `documents`), one pair of fields.",
                              param="text_1")
        name_1, name_2 = given[0]
        first, second = _as_list(getattr(self, name_1)), _as_list(getattr(self, name_2))
        for name, texts in ((name_1, first), (name_2, second)):
            if not texts:
                raise OpenAIError(400, f"`{name}` must hold at least one text.", param=name)
            check_not_empty(texts, name)
        if len(first) == 1:
            first = first * len(second)
        elif len(first) != len(second):
            raise OpenAIError(400, f"`{name_1}` has {len(first)} texts and `{name_2}` "
                              f"{len(second)}: give one and N, or N and N.", param=name_2)
        return first, second, name_1


class RerankRequest(ActivationFields):
    """POST /rerank (and /v1/rerank, /v2/rerank: Jina's and Cohere's shape)."""

    query: str
    documents: list[str]
    #: The best this many results; 0: every document (vLLM's default).
    top_n: int = 0
    #: Each result carries its document's text (vLLM always sends it; Cohere's field).
    return_documents: bool = True


def check_not_empty(texts: list[str], name: str) -> None:
    if any(not text for text in texts):
        raise OpenAIError(400, f"`{name}` holds an empty text.", param=name)


def _as_list(texts: Texts | None) -> list[str]:
    if texts is None:
        return []
    return [texts] if isinstance(texts, str) else list(texts)

