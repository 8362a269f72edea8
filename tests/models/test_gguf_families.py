"""Qwen2, Qwen3, Phi-3 and Gemma 3 GGUF files, written here as llama.cpp writes them (their
own metadata keys, q/k rows as HF keeps them, attention biases for Qwen2,
attn_q_norm/attn_k_norm for Qwen3 and Gemma 3, Phi-3's fused attn_qkv and gate/up, Gemma's
norms stored plus one, a tied or a separate output, the qwen2 pre-tokenizer or a
SentencePiece vocabulary, the chat template), served
from the file alone: the config from its metadata, the tokenizer from its vocabulary, and
the same token ids and logits as transformers reading the same file; a tensor missing or of
another shape than the metadata implies is refused by name before any weight is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.models.info.paths import read_model_info
from gateway.models.info.support import UnsupportedModelError, check_supported
from gateway.tokenizer import load_tokenizer
from tests.models.test_decoder_archs import _short_mixed_run
from tests.models.tiny_gguf import write_tiny_gguf
from tests.test_gguf_tokenizer import FAMILIES as SPM_FAMILIES
from tests.tiny_model import CHAT_TEMPLATE, build_tiny_decoder

# the CPU's instruction set decides the paths; exact products (8-bit activations: test_quant_int8)
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("exact_float32_products")]

# general.architecture -> (HF architecture, the tiny model's config changes).
FAMILIES: dict[str, tuple[str, dict[str, object]]] = {
    "qwen2": ("Qwen2ForCausalLM", {"tie_word_embeddings": True, "rope_theta": 1_000_000.0}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 128, "use_sliding_window": False,
                                   "rope_theta": 50_000.0}),
}
TEXTS = ["Hello, world! The quick brown fox.", "0123456789 and 3.14159 + 2,048 = ?",
         "  two spaces,\n\nnew lines\tand a tab ", "naïve café — 東京 ü\u0301",
         "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", "I'm you'LL we've"]


def write_family_gguf(root: Path, arch: str) -> Path:
    """The tiny model of family `arch` as `root/arch/arch.gguf`, alone in its folder (so
    nothing but the file can be read)."""
    hf_arch, config = FAMILIES[arch]
    folder = build_tiny_decoder(root / f"{arch}-hf", hf_arch, **config)
    (root / arch).mkdir()
    return write_tiny_gguf(folder, root / arch / f"{arch}.gguf", arch=arch, pre="qwen2",
                           chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-families")
    return {arch: write_family_gguf(root, arch) for arch in FAMILIES}


def reference_model(path: Path, **config: object):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32, **config).eval()


def reference_tokenizer(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_the_config_comes_from_the_metadata(ggufs: dict[str, Path]) -> None:
    qwen2, qwen3 = read_model_info(ggufs["qwen2"]), read_model_info(ggufs["qwen3"])
    assert (qwen2.architecture, qwen3.architecture) == ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    assert qwen2.hf_config["tie_word_embeddings"] is True
    assert qwen3.hf_config["tie_word_embeddings"] is False
    assert (qwen2.head_dim, qwen3.head_dim) == (16, 128)  # Qwen3: key_length, not 64 // 4
    assert qwen2.hf_config["rope_theta"] == 1_000_000.0
    assert qwen3.hf_config["rope_theta"] == 50_000.0


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_token_ids_equal_transformers(ggufs: dict[str, Path], arch: str) -> None:
    ours, theirs = load_tokenizer(ggufs[arch]), reference_tokenizer(ggufs[arch])
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip), text
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_logits_equal_transformers_reading_the_same_file(ggufs: dict[str, Path],
                                                         arch: str) -> None:
    assert _short_mixed_run(ggufs[arch], reference_model(ggufs[arch])) > 40


@pytest.mark.parametrize(("change", "message"), [
    (lambda arrays: {k: v for k, v in arrays.items() if k != "blk.1.attn_k_norm.weight"},
     "tensor 'blk.1.attn_k_norm.weight' is missing (the qwen3.* metadata implies it)"),
    (lambda arrays: {**arrays, "blk.0.attn_q_norm.weight": arrays["blk.0.attn_q_norm.weight"][:64]},
     "tensor 'blk.0.attn_q_norm.weight' has shape [64], but the qwen3.* metadata implies [128]"),
    (lambda arrays: {**arrays, "blk.0.attn_q.bias": arrays["blk.0.attn_q_norm.weight"]},
     "tensor 'blk.0.attn_q.bias' is not a weight of a qwen3 model"),
])
def test_a_tensor_that_disagrees_with_the_metadata_is_named(  # type: ignore[no-untyped-def]
        ggufs: dict[str, Path], tmp_path: Path, change, message: str) -> None:
    folder = ggufs["qwen3"].parent.parent / "qwen3-hf"
    path = write_tiny_gguf(folder, tmp_path / "bad.gguf", arch="qwen3", pre="qwen2",
                           tensors=change)
    with pytest.raises(UnsupportedModelError) as refused:
        check_supported(read_model_info(path))
    assert str(refused.value) == f"Model {path} cannot be served: {message}"


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Phi-3 (full rotary, as transformers reads a Phi-3 GGUF) with a SentencePiece
    vocabulary, as llama.cpp writes it: q/k/v fused in attn_qkv, gate and up in ffn_up."""
    from tests.test_gguf_tokenizer import train_sentencepiece

    root = tmp_path_factory.mktemp("phi3-gguf")
    proto = train_sentencepiece("phi3")
    folder = build_tiny_decoder(root / "hf", "Phi3ForCausalLM", vocab_size=_num_pieces(proto),
                                partial_rotary_factor=1.0)
    (root / "gguf").mkdir()
    (root / "spm.model").write_bytes(proto)  # for variants of the file
    return write_tiny_gguf(folder, root / "gguf" / "phi3.gguf", arch="phi3",
                           sentencepiece=proto, chat_template=SPM_FAMILIES["phi3"][2])


def _num_pieces(proto: bytes) -> int:
    import sentencepiece

    return int(sentencepiece.SentencePieceProcessor(model_proto=proto).get_piece_size())


def test_phi3_logits_equal_transformers_reading_the_same_file(phi3_gguf: Path) -> None:
    assert read_model_info(phi3_gguf).architecture == "Phi3ForCausalLM"
    # Phi3Config's default pad id (32000) lies past the tiny vocabulary.
    assert _short_mixed_run(phi3_gguf, reference_model(phi3_gguf, pad_token_id=None)) > 40


def test_phi3_partial_rotary_and_window_come_from_the_metadata(tmp_path: Path) -> None:
    from gateway.models.info.decoder_config import read_decoder_config

    folder = build_tiny_decoder(tmp_path / "hf", "Phi3ForCausalLM", sliding_window=8)
    path = write_tiny_gguf(folder, tmp_path / "phi3.gguf", arch="phi3")
    info = read_model_info(path)
    config = read_decoder_config(info.architecture, info.hf_config)
    assert (config.rotary_dim, config.head_dim) == (8, 16)  # partial_rotary_factor 0.5
    assert config.layer_windows == (8, 8) and config.fused_checkpoint
    check_supported(info)  # the fused tensors' shapes agree with the metadata


def test_a_longrope_phi3_file_is_refused_by_name(tmp_path: Path) -> None:
    folder = build_tiny_decoder(tmp_path / "hf", "Phi3ForCausalLM")
    path = write_tiny_gguf(folder, tmp_path / "phi3.gguf", arch="phi3", tensors=lambda arrays: {
        **arrays, "rope_factors_long.weight": arrays["output_norm.weight"][:8]})
    with pytest.raises(UnsupportedModelError, match="tensor 'rope_factors_long.weight' holds "
                                                    "longrope factors, which are not read"):
        check_supported(read_model_info(path))


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 with a Gemma-style SentencePiece vocabulary, as llama.cpp writes it:
    norms stored plus one, sandwich norms, q/k norms, a tied output, a window on five
    layers of six. What the file cannot say is transformers' default for both readers
    (query_pre_attn_scalar = head_dim = 256, no soft-capping)."""
    from tests.test_gguf_tokenizer import train_sentencepiece

    root = tmp_path_factory.mktemp("gemma3-gguf")
    proto = train_sentencepiece("gemma3", add_dummy_prefix=False)
    folder = build_tiny_decoder(
        root / "hf", "Gemma3ForCausalLM", vocab_size=_num_pieces(proto), num_hidden_layers=6,
        head_dim=256, query_pre_attn_scalar=256, sliding_window=8, layer_types=None,
        final_logit_softcapping=None, tie_word_embeddings=True)
    (root / "gguf").mkdir()
    (root / "spm.model").write_bytes(proto)  # for variants of the file
    return write_tiny_gguf(folder, root / "gguf" / "gemma3.gguf", arch="gemma3",
                           sentencepiece=proto, chat_template=SPM_FAMILIES["gemma3"][2])


def test_gemma3_logits_equal_transformers_reading_the_same_file(gemma3_gguf: Path) -> None:
    info = read_model_info(gemma3_gguf)
    assert info.architecture == "Gemma3ForCausalLM"
    assert info.hf_config["sliding_window"] == 8 and info.head_dim == 256
    assert _short_mixed_run(gemma3_gguf, reference_model(gemma3_gguf)) > 40


@pytest.mark.parametrize(("arch", "qtype"), [("phi3", "Q4_0"), ("gemma3", "Q8_0")])
def test_quantized_weights_kept_in_the_kernels_equal_transformers(
        request: pytest.FixtureRequest, tmp_path: Path, arch: str, qtype: str) -> None:
    """Phi-3's fused q/k/v and gate/up and Gemma 3's layers, their weights kept quantized
    (float32 from the codes), against transformers dequantizing the same file."""
    import gguf

    root = request.getfixturevalue(f"{arch}_gguf").parent.parent
    path = write_tiny_gguf(root / "hf", tmp_path / f"{arch}-{qtype}.gguf",
                           gguf.GGMLQuantizationType[qtype], arch=arch,
                           sentencepiece=(root / "spm.model").read_bytes())
    reference = reference_model(path, **({"pad_token_id": None} if arch == "phi3" else {}))
    assert _short_mixed_run(path, reference) > 40


def _greedy_ids(model, prompt_ids: list[int], max_tokens: int, eos_id: int) -> list[int]:  # type: ignore[no-untyped-def]
    ids: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(torch.tensor([prompt_ids + ids])).logits[0, -1].argmax())
            ids.append(token)
            if token == eos_id:
                break
    return ids


@pytest.mark.e2e
@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma3"])
def test_gateway_serve_chats_from_a_gguf_file_as_transformers(
        request: pytest.FixtureRequest, arch: str, tmp_path: Path) -> None:
    """`gateway serve FILE.gguf`, through the openai SDK: the chat template and the tokens
    come from the file, and greedy output equals transformers' reading the same file."""
    import openai

    from tests.plugin_dists import subprocess_env
    from tests.server import ServerProcess

    path = (request.getfixturevalue("ggufs")["qwen3"] if arch == "qwen3"
            else request.getfixturevalue(f"{arch}_gguf"))
    tokenizer = reference_tokenizer(path)
    reference = reference_model(path, **({"pad_token_id": None} if arch == "phi3" else {}))
    messages = [{"role": "user", "content": "Summarize the following text."}]
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=False)
    expected_prompt_ids = tokenizer.encode(expected_prompt, add_special_tokens=False)
    env = subprocess_env()
    env.pop("VLLM_API_KEY", None)
    flags = [str(path), "--max-model-len", "256", "--disable-uvicorn-access-log"]
    with ServerProcess(flags, env=env, log_path=tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                               timeout=120)
        (model,) = client.models.list().data
        result = client.chat.completions.create(
            model=model.id, messages=messages, max_completion_tokens=12, temperature=0,
            extra_body={"return_token_ids": True})
    assert result.model_extra["prompt_token_ids"] == expected_prompt_ids
    token_ids = result.choices[0].model_extra["token_ids"]
    assert token_ids == _greedy_ids(reference, expected_prompt_ids, 12,
                                    tokenizer.eos_token_id)
    # A run of byte tokens that is not UTF-8 decodes otherwise token by token (the front
    # end's stream) than as one run (tokenizers'); the text is compared where there is none.
    if not any(t.startswith("<0x") for t in tokenizer.convert_ids_to_tokens(token_ids)):
        assert result.choices[0].message.content == tokenizer.decode(
            token_ids, skip_special_tokens=True)


@pytest.mark.e2e
def test_a_repo_quant_id_serves_a_quantized_qwen2_gguf_from_the_hf_cache(
        ggufs: dict[str, Path], tmp_path: Path) -> None:
    """`gateway serve org/name:Q8_0`, offline from the Hugging Face cache: the repo's Q8_0
    file is chosen, its weights stay quantized in the CPU kernels (float32 from the codes),
    and greedy output equals transformers' reading the same file."""
    import gguf
    import openai

    from tests.models.hf_cache import add_to_hf_cache
    from tests.plugin_dists import subprocess_env
    from tests.server import ServerProcess

    folder, repo = ggufs["qwen2"].parent.parent / "qwen2-hf", "tiny-org/Tiny-Qwen2-GGUF"
    quantized = write_tiny_gguf(folder, tmp_path / "Tiny-Qwen2-Q8_0.gguf",
                                gguf.GGMLQuantizationType.Q8_0, arch="qwen2", pre="qwen2",
                                chat_template=CHAT_TEMPLATE)
    cache = tmp_path / "hub"
    add_to_hf_cache(cache, repo, {"Tiny-Qwen2-F32.gguf": ggufs["qwen2"],
                                  "Tiny-Qwen2-Q8_0.gguf": quantized})
    tokenizer, reference = reference_tokenizer(quantized), reference_model(quantized)
    prompt_ids = tokenizer.encode("Once upon a time there was")
    env = subprocess_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    env.pop("VLLM_API_KEY", None)
    flags = [f"{repo}:Q8_0", "--max-model-len", "256", "--disable-uvicorn-access-log"]
    with ServerProcess(flags, env=env, log_path=tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                               timeout=120)
        assert [m.id for m in client.models.list().data] == [f"{repo}:Q8_0"]
        result = client.completions.create(
            model=f"{repo}:Q8_0", prompt=prompt_ids, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        log = (tmp_path / "server.log").read_text()
    assert "kept quantized" in log, log
    assert result.choices[0].model_extra["token_ids"] == _greedy_ids(
        reference, prompt_ids, 8, eos_id=-1)
