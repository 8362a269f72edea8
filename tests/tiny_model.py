"""A tiny random Llama as a real HF folder: config.json, model.safetensors, tokenizer.json
(a byte-level BPE trained here), tokenizer_config.json with a ChatML chat template, and
generation_config.json. Loads in well under a second, so end-to-end tests can start real
servers on it. Built with transformers (which imports torch: tests only, never the
gateway's front end)."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! This is a tiny model for tests.",
    "Summarize the following text in one sentence.",
    "Plugins extend the gateway through Python entry points.",
    "Once upon a time there was a server that answered every request.",
    "0123456789 + - * / = ( ) [ ] { } < > : ; ' \" , . ? !",
]


def build_tiny_llama(folder: Path, *, vocab_size: int = 512,
                     max_position_embeddings: int = 4096, seed: int = 0,
                     **config: object) -> Path:
    """Write the tiny model into `folder` (created) and return it; `config` overrides
    fields of its transformers LlamaConfig (heads, tie_word_embeddings, biases, ...)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_vocab = _write_tokenizer(folder, vocab_size)
    _write_model(folder, tokenizer_vocab, max_position_embeddings, seed, config)
    return folder


# Each decoder family's tiny config: small windows, so that sliding windows, partial rotary
# and soft-capping all act on the tests' short prompts.
DECODER_FAMILIES: dict[str, dict[str, object]] = {
    "MistralForCausalLM": {"sliding_window": 8},
    "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": {"head_dim": 16, "use_sliding_window": True, "sliding_window": 8,
                         "max_window_layers": 1},
    "Gemma3ForCausalLM": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
                          "layer_types": ["sliding_attention", "full_attention"],
                          "final_logit_softcapping": 5.0},
    "Phi3ForCausalLM": {"partial_rotary_factor": 0.5, "pad_token_id": None},
    # Mixtures of experts: 8 experts, few tokens each; Qwen3-MoE's layer 1 a plain MLP.
    "Qwen3MoeForCausalLM": {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 3,
                            "moe_intermediate_size": 48, "norm_topk_prob": True,
                            "mlp_only_layers": [1], "use_sliding_window": True,
                            "sliding_window": 8},
    "MixtralForCausalLM": {"num_local_experts": 8, "num_experts_per_tok": 2,
                           "intermediate_size": 48},
}


def build_tiny_decoder(folder: Path, architecture: str, *, seed: int = 0,
                       **config: object) -> Path:
    """A tiny random decoder of `architecture` (a key of DECODER_FAMILIES, whose config it
    starts from; `config` overrides fields) as an HF folder, with build_tiny_llama's
    tokenizer. Biases and norm weights are random too, so that every parameter counts."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = _write_tokenizer(folder, 512)
    _write_model(folder, vocab_size, 4096, seed,
                 {**DECODER_FAMILIES[architecture], **config}, architecture)
    return folder


def _write_tokenizer(folder: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS * 20, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "bos_token": None, "eos_token": "<|im_end|>",
        "clean_up_tokenization_spaces": False, "model_max_length": 4096,
    }))
    return int(tokenizer.get_vocab_size(with_added_tokens=True))


def _write_model(folder: Path, vocab_size: int, max_position_embeddings: int,
                 seed: int, overrides: dict[str, object],
                 architecture: str = "LlamaForCausalLM") -> None:
    import torch
    import transformers

    eos_token_id = SPECIAL_TOKENS.index("<|im_end|>")
    fields: dict[str, object] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        bos_token_id=None, eos_token_id=eos_token_id, tie_word_embeddings=False)
    family = architecture.removesuffix("ForCausalLM")
    config_cls = getattr(transformers, f"{family}TextConfig", None) or \
        getattr(transformers, f"{family}Config")
    config = config_cls(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    with torch.no_grad():  # transformers zeroes biases; random ones make them count in tests
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif architecture != "LlamaForCausalLM" and "norm" in name:
                param.normal_(0.5 if "Gemma" in family else 1.0, 0.2)
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos_token_id}))


BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_tiny_bert(folder: Path, *, max_position_embeddings: int = 256, seed: int = 0,
                    normalize: bool = True, pooling: str | None = "mean") -> Path:
    """A tiny random BERT encoder as a sentence-transformers folder: config.json,
    model.safetensors, a WordPiece tokenizer.json trained here (lower-casing, [CLS]/[SEP]
    added), tokenizer_config.json, and modules.json naming a Pooling module (`pooling`,
    None: no modules.json) and, when `normalize`, a Normalize module."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = _write_wordpiece_tokenizer(folder)
    _write_bert(folder, vocab_size, max_position_embeddings, seed)
    if pooling is not None:
        _write_sentence_transformers_modules(folder, pooling, normalize)
    return folder


def _write_wordpiece_tokenizer(folder: Path) -> int:
    import re

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    # A fixed vocabulary (WordPieceTrainer's varies from run to run): the corpus's words,
    # and every character alone and as a "##" continuation, so any ASCII text encodes.
    words = sorted({w for text in _CORPUS for w in re.findall(r"\w+|[^\w\s]", text.lower())})
    chars = [chr(c) for c in range(33, 127) if not chr(c).isupper()]
    tokens = list(dict.fromkeys(BERT_SPECIAL_TOKENS + chars + [f"##{c}" for c in chars] + words))
    tokenizer = Tokenizer(models.WordPiece({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(BERT_SPECIAL_TOKENS)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 512,
        **{f"{name}_token": f"[{name.upper()}]" for name in ("pad", "unk", "cls", "sep", "mask")},
    }))
    return int(tokenizer.get_vocab_size(with_added_tokens=True))


def _write_bert(folder: Path, vocab_size: int, max_position_embeddings: int,
                seed: int) -> None:
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=max_position_embeddings)
    torch.manual_seed(seed)
    BertModel(config, add_pooling_layer=False).to(torch.float32).save_pretrained(folder)


def _write_sentence_transformers_modules(folder: Path, pooling: str, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = {"mean": "mean_tokens", "cls": "cls_token", "max": "max_tokens",
             "lasttoken": "lasttoken"}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64,
         **{f"pooling_mode_{mode}": mode == modes[pooling] for mode in modes.values()}}))


ROBERTA_SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # ids 0..4: pad_token_id 1
_ENCODER_CONFIGS = {"Bert": "BertConfig", "Roberta": "RobertaConfig",
                    "XLMRoberta": "XLMRobertaConfig"}


def build_tiny_encoder(folder: Path, architecture: str, *, num_labels: int = 2,
                       max_position_embeddings: int = 130, seed: int = 0,
                       **config: object) -> Path:
    """A tiny random encoder of a transformers `architecture` (BertModel, RobertaModel,
    XLMRobertaModel, or one of their *ForSequenceClassification with `num_labels`) as an
    HF folder: BERT's WordPiece tokenizer (token types for pairs) or, for the RoBERTa
    family, a byte-level BPE with RoBERTa's `<s> A </s></s> B </s>` pairs. Biases,
    token-type embeddings and the head's weights are large and random, so that they count.
    An embedding model gets mean pooling (modules.json) and
    normalises; `config` overrides fields of its transformers config."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    family = architecture.removesuffix("Model").removesuffix("ForSequenceClassification")
    is_bert = family == "Bert"
    vocab_size = _write_wordpiece_tokenizer(folder) if is_bert else _write_roberta_tokenizer(folder)
    fields: dict[str, object] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=max_position_embeddings,
        num_labels=num_labels, initializer_range=0.2)  # 0.02 makes every input look alike
    if not is_bert:  # RoBERTa's positions start at pad_token_id + 1, with one token type
        fields.update(pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
                      max_position_embeddings=max_position_embeddings + 2)
    hf_config = getattr(transformers, _ENCODER_CONFIGS[family])(**{**fields, **config})
    torch.manual_seed(seed)
    model_cls = getattr(transformers, architecture)
    is_embedding = architecture.endswith("Model")
    model = (model_cls(hf_config, add_pooling_layer=False) if is_embedding
             else model_cls(hf_config)).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "token_type_embeddings" in name:
                param.normal_(0.0, 0.5)
            elif name.startswith(("classifier.", "bert.pooler.")):  # else the bias is all
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    if is_embedding:
        _write_sentence_transformers_modules(folder, "mean", normalize=True)
    return folder


def _write_roberta_tokenizer(folder: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=ROBERTA_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS * 20, trainer)
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0),
                                                            add_prefix_space=False)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512,
        "bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>",
        "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}))
    return int(tokenizer.get_vocab_size(with_added_tokens=True))
