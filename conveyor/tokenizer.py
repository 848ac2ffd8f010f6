"""The model's tokenizer and chat template, built from a GGUF file's metadata or a Hugging Face folder.

GGUF files carry no ``tokenizer.json``: the vocabulary, merges, token types and the name of the
pre-tokenizer are metadata under llama.cpp's keys. We rebuild the same byte-level BPE with the
``tokenizers`` library. The pre-tokenizer (how text is split before BPE) is looked up by the name
the file gives in ``tokenizer.ggml.pre``, with the split rules llama.cpp uses for that name.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from conveyor.cache import cache_dir_for, write_atomic
from conveyor.model_files import ModelFileError, ModelSource, resolve_model

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a vocabulary, back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_LEVEL = _byte_level_decoder()

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level() -> pre_tokenizers.PreTokenizer:
    """GPT-2's own split regex followed by the byte-to-unicode mapping."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    """Every digit on its own, then GPT-2's split (StarCoder / SmolLM vocabularies)."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


def _split_then_bytes(pattern: str):
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


# tokenizer.ggml.pre -> pre-tokenizer, as llama.cpp splits text for each name
PRE_TOKENIZERS = {
    "default": _byte_level,
    "gpt-2": _byte_level,
    "gpt2": _byte_level,
    "smollm": _digits_then_byte_level,
    "starcoder": _digits_then_byte_level,
    "refact": _digits_then_byte_level,
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "smaug-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _split_then_bytes(_QWEN2_SPLIT),
}
# Vocabularies whose reference tokenizer takes a whole word from the vocabulary before merging.
IGNORE_MERGES = {"llama-bpe", "llama3", "smaug-bpe"}


@dataclass
class ModelTokenizer:
    """A ``tokenizers.Tokenizer`` plus what a server needs around it: special ids and the chat template."""

    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # "bos_token"/"eos_token" -> text

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token text such as ``<|im_start|>`` becomes its one id."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; bytes that do not yet form a whole character come out as U+FFFD."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (OpenAI's logprob ``bytes``): part of a character for a byte-fallback or
        byte-level piece, where its decoded text would be U+FFFD."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if (byte := _BYTE_PIECE.fullmatch(piece)) is not None:
            return bytes([int(byte.group(1), 16)])
        if isinstance(self.tokenizer.decoder, decoders.ByteLevel) and all(c in BYTE_LEVEL for c in piece):
            return bytes(BYTE_LEVEL[c] for c in piece)
        return self.decode([token_id]).encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's own template; ``tools``: the
        function definitions, for a template that takes them (``supports_tools``)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a prompt instead of messages")
        template = _jinja_env().from_string(self.chat_template)
        extra = {"tools": tools} if tools else {}
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens,
                               **extra)

    @functools.cached_property
    def supports_tools(self) -> bool:
        """The chat template reads a ``tools`` variable (it describes the tools itself). Parsed once: every chat
        request asks."""
        from jinja2 import meta

        if not self.chat_template:
            return False
        return "tools" in meta.find_undeclared_variables(_jinja_env().parse(self.chat_template))


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # The settings Hugging Face templates are written for.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def load_tokenizer(model: str | Path | ModelSource | None) -> ModelTokenizer:
    """The tokenizer of ``--model`` (``None``/``"default"``, a ``.gguf`` file or a HF folder)."""
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    if source.kind == "hf":
        return tokenizer_from_hf_folder(source.path)
    folder = cache_dir_for(source.path)
    tok_file, meta_file = folder / "tokenizer.json", folder / "tokenizer_meta.json"
    if tok_file.is_file() and meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        meta["eos_token_ids"] = tuple(meta["eos_token_ids"])
        return ModelTokenizer(Tokenizer.from_file(str(tok_file)), **meta)
    from conveyor.gguf_file import GGUFFile

    built = tokenizer_from_gguf(GGUFFile(source.path))
    write_atomic(tok_file, lambda tmp: built.tokenizer.save(str(tmp)))
    meta = {k: v for k, v in built.__dict__.items() if k != "tokenizer"}
    write_atomic(meta_file, lambda tmp: tmp.write_text(json.dumps(meta)))
    return built


def tokenizer_from_gguf(gguf) -> ModelTokenizer:
    """Byte-level BPE from ``tokenizer.ggml.*`` metadata (``gguf``: a ``conveyor.gguf_file.GGUFFile``)."""
    kind = gguf.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelFileError(
            f"{gguf.path.name}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') GGUF tokenizers are supported"
        )
    pre = gguf.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelFileError(
            f"{gguf.path.name}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported (supported: {sorted(PRE_TOKENIZERS)})"
        )
    tokens: list[str] | None = gguf.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFileError(f"{gguf.path.name}: no tokenizer.ggml.tokens (the file carries no vocabulary)")
    merges = [tuple(m.split(" ", 1)) for m in gguf.get("tokenizer.ggml.merges") or []]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=pre in IGNORE_MERGES)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    types = gguf.get("tokenizer.ggml.token_type", [])
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_TYPE_CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_TYPE_USER_DEFINED]
    )
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    if gguf.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    eos_ids = [gguf.get(key) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    eos_ids = tuple(dict.fromkeys(i for i in eos_ids if i is not None))
    specials = {"bos_token": tokens[bos] if bos is not None else "", "eos_token": tokens[eos_ids[0]] if eos_ids else ""}
    return ModelTokenizer(tok, eos_ids, bos, gguf.get("tokenizer.chat_template"), specials)


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def tokenizer_from_hf_folder(folder: Path) -> ModelTokenizer:
    """``tokenizer.json`` + ``tokenizer_config.json`` (+ ``generation_config.json`` for eos ids)."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tcfg = _read_json(folder / "tokenizer_config.json")
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    bos_text, eos_text = _token_text(tcfg.get("bos_token")), _token_text(tcfg.get("eos_token"))
    gen, cfg = _read_json(folder / "generation_config.json"), _read_json(folder / "config.json")
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    if eos is None and eos_text is not None:
        eos = tok.token_to_id(eos_text)
    eos_ids = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
    specials = {"bos_token": bos_text or "", "eos_token": eos_text or ""}
    return ModelTokenizer(tok, eos_ids, bos, template, specials)
