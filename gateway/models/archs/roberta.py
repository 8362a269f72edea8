"""RoBERTa and XLM-R encoders (RobertaModel, XLMRobertaModel) for embeddings (worker process).

Both are BERT's layers (bert.py) with two differences in the embeddings: positions count
from `pad_token_id + 1` (fairseq's convention: position `pad_token_id` is the padding's, and
real tokens follow it), and there is a single token type (`type_vocab_size` 1), so a
sentence pair is told apart by its separator tokens only. Task checkpoints keep the
encoder under "roberta." (also XLM-R's). The model's context is therefore
`max_position_embeddings - pad_token_id - 1` tokens (514 -> 512), as paths.py reports it.

Shapes: N tokens in the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from gateway.models.archs.bert import BertModel
from gateway.models.info.paths import position_offset


class RobertaModel(BertModel):
    checkpoint_prefix: ClassVar[str] = "roberta."

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__(hf_config)
        self.position_offset = position_offset(hf_config)  # pad_token_id + 1: 2 for both

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                seq_lens: Sequence[int], token_type_ids: torch.Tensor | None = None,
                ) -> torch.Tensor:
        """As BertModel's, positions [N] counted from 0 in each sequence."""
        return super().forward(input_ids, positions + self.position_offset, seq_lens,
                               token_type_ids)


class XLMRobertaModel(RobertaModel):
    """XLM-R: RoBERTa's architecture with a larger (SentencePiece) vocabulary."""
