"""Sequence classification on BERT-style encoders (worker process):
BertForSequenceClassification, RobertaForSequenceClassification and
XLMRobertaForSequenceClassification (task `classify`; with one label, a cross-encoder,
task `score`).

Each is its encoder (bert.py, roberta.py) plus transformers' head on the first token ([CLS]
or <s>) of each sequence: BERT's pooler (dense + tanh) then `classifier`; RoBERTa's
`classifier.dense` + tanh then `classifier.out_proj`. The head returns logits, which the
model's activation (`classify_activation`, `score_activation`) turns into what /classify
and /score answer. Shapes: N tokens, S sequences, E hidden size, C labels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gateway.models.archs.bert import BertModel
from gateway.models.archs.roberta import RobertaModel
from gateway.models.info.paths import classifier_tasks, num_labels

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda logits: logits,
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
}
# sentence-transformers' activation_fn (a torch.nn module's class name) -> ours; Sigmoid and
# Softmax mean "the classification default", as vLLM reads them.
_CROSS_ENCODER_ACTIVATIONS = {"Identity": "identity", "Sigmoid": "default", "Softmax": "default"}


def classify_activation(hf_config: dict[str, Any]) -> str:
    """The activation of task `classify` (vLLM's rules, after transformers' losses):
    `problem_type` regression: none; multi-label: sigmoid; otherwise sigmoid for one label,
    softmax over several.
    """
    problem = hf_config.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    return "sigmoid" if num_labels(hf_config) < 2 else "softmax"


def score_activation(hf_config: dict[str, Any]) -> str:
    """The cross-encoder's activation (task `score`): the one a sentence-transformers
    CrossEncoder names in the config (`sentence_transformers.activation_fn`, or
    `sbert_ce_default_activation_function`), else sigmoid, as CrossEncoder applies to a
    one-label model. A ValueError names one that is not supported.
    """
    named = (hf_config.get("sentence_transformers") or {}).get("activation_fn") \
        or hf_config.get("sbert_ce_default_activation_function")
    if named is None:
        return classify_activation(hf_config)
    kind = _CROSS_ENCODER_ACTIVATIONS.get(str(named).rpartition(".")[2])
    if kind is None or not str(named).startswith("torch.nn."):
        raise ValueError(f"The cross-encoder activation {named!r} is not supported "
                         f"(torch.nn's {', '.join(_CROSS_ENCODER_ACTIVATIONS)})")
    return classify_activation(hf_config) if kind == "default" else kind


def first_tokens(hidden: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
    """hidden [N, E] of packed sequences -> each sequence's first token [S, E]."""
    lengths = torch.tensor(seq_lens, dtype=torch.int64, device=hidden.device)
    return hidden[torch.cumsum(lengths, 0) - lengths]


class _ClassifierMixin:
    """What the pooling runner needs of a classifier, on top of the encoder's forward."""

    supported_tasks: tuple[str, ...]
    activations: dict[str, str]

    def _init_classifier(self, hf_config: dict[str, Any]) -> None:
        self.supported_tasks = classifier_tasks(hf_config)
        self.num_labels = num_labels(hf_config)
        self.activations = {"classify": classify_activation(hf_config),
                            "score": score_activation(hf_config)}

    def activate(self, logits: torch.Tensor, task: str) -> torch.Tensor:
        """logits [S, C] -> what `task` answers (probabilities, or the scores) [S, C]."""
        return _ACTIVATIONS[self.activations[task]](logits)


class BertPooler(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(size, size)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first))  # [S, E]


class BertForSequenceClassification(_ClassifierMixin, BertModel):
    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__(hf_config)
        self._init_classifier(hf_config)
        size = self.config.hidden_size
        self.pooler = BertPooler(size)
        self.classifier = nn.Linear(size, self.num_labels)

    def classify(self, hidden: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        """hidden [N, E] -> logits [S, C]."""
        return self.classifier(self.pooler(first_tokens(hidden, seq_lens)))


class RobertaClassificationHead(nn.Module):
    def __init__(self, size: int, labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(size, size)
        self.out_proj = nn.Linear(size, labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))  # [S, C]


class RobertaForSequenceClassification(_ClassifierMixin, RobertaModel):
    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__(hf_config)
        self._init_classifier(hf_config)
        self.classifier = RobertaClassificationHead(self.config.hidden_size, self.num_labels)

    def classify(self, hidden: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        """hidden [N, E] -> logits [S, C]."""
        return self.classifier(first_tokens(hidden, seq_lens))


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    """XLM-R's classifiers and rerankers (bge-reranker): RoBERTa's head."""
