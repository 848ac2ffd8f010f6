"""The tokenizer rebuilt from GGUF metadata against transformers' own GGUF tokenizer."""

from __future__ import annotations

import gguf
import pytest

from conveyor.model_files import ModelFileError
from conveyor.tokenizer import load_tokenizer, tokenizer_from_gguf

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see!",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\n}",
    "    leading spaces, trailing spaces    ",
    "tabs\t\t\tand\n\n\nnewlines\r\n  mixed \t \n ",
    "안녕하세요, 세계! 오늘 날씨가 정말 좋네요. 한국어 형태소 분석은 어렵습니다.",
    "你好，世界。这是一个中文句子，包含标点符号！机器学习很有趣。",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇰🇷🇺🇸 and ✨sparkles✨",
    "Mixed: English 한국어 中文 日本語 😀 123 4567 3.14159 -42 1e10",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "",
    " ",
    "a",
    "https://example.org/path?query=1&other=two#frag  ~!@#$%^&*()_+{}|:\"<>?",
]


@pytest.fixture(scope="module")
def ours():
    return load_tokenizer("default")


@pytest.mark.parametrize("text", CORPUS)
def test_gguf_tokenizer_matches_transformers(ours, hf_tokenizer, text):
    expected = hf_tokenizer(text, add_special_tokens=True).input_ids
    assert ours.encode(text) == expected


@pytest.mark.parametrize("text", CORPUS)
def test_decode_gives_the_same_text_back(ours, text):
    assert ours.decode(ours.encode(text)) == text


def test_special_tokens_and_eos(ours, hf_tokenizer):
    assert ours.eos_token_ids == (hf_tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert ours.encode("<|im_start|>") == [hf_tokenizer.convert_tokens_to_ids("<|im_start|>")]
    assert ours.vocab_size == len(hf_tokenizer)


def test_chat_template_matches_transformers(ours, hf_tokenizer):
    conversations = [
        [{"role": "user", "content": "Hi there!"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "안녕?"},
            {"role": "assistant", "content": "안녕하세요."},
            {"role": "user", "content": "Count to 3."},
        ],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours.apply_chat_template(messages, add_generation_prompt) == expected


def test_cold_and_cached_tokenizer_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    cold = load_tokenizer("default")
    assert list(tmp_path.rglob("tokenizer.json")), "the built tokenizer was not cached"
    warm = load_tokenizer("default")
    for text in CORPUS:
        assert warm.encode(text) == cold.encode(text)
    assert (warm.eos_token_ids, warm.bos_token_id, warm.chat_template) == (
        cold.eos_token_ids, cold.bos_token_id, cold.chat_template,
    )


def _write_gguf(path, pre: str, model: str = "gpt2"):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_token_types([1, 1, 1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_pre_tokenizer_is_a_clear_error(tmp_path):
    from conveyor.gguf_file import GGUFFile

    path = tmp_path / "odd.gguf"
    _write_gguf(path, "mystery-pre")
    with pytest.raises(ModelFileError, match="tokenizer.ggml.pre='mystery-pre'"):
        tokenizer_from_gguf(GGUFFile(path))


def test_sentencepiece_gguf_is_a_clear_error(tmp_path):
    from conveyor.gguf_file import GGUFFile

    path = tmp_path / "spm.gguf"
    _write_gguf(path, "default", model="llama")
    with pytest.raises(ModelFileError, match="tokenizer.ggml.model is 'llama'"):
        tokenizer_from_gguf(GGUFFile(path))
