"""Tokenizers for ``meshrun data prepare``: bytes built in; tiktoken and Hugging Face optional.

A tokenizer is named by a spec string that goes into the manifest, so a dataset always says
how it was made: ``bytes``, ``tiktoken:NAME`` (e.g. ``tiktoken:gpt2``) or ``hf:FILE_OR_NAME``
(a ``tokenizer.json`` file or a Hugging Face Hub name). The optional libraries are imported
only when asked for, and are never dependencies of meshrun.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = ["BYTES_EOT", "ByteTokenizer", "Tokenizer", "get_tokenizer", "token_dtype"]

BYTES_EOT = 256  # the byte tokenizer's end-of-document id, just past the 256 byte values


class Tokenizer(Protocol):
    """What ``prepare`` needs: a stable spec, the vocabulary size, an end-of-document id."""

    @property
    def spec(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eot(self) -> int: ...
    def encode(self, text: bytes) -> np.ndarray: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0-255 and 256 as end of document: no vocabulary file, no download."""

    spec: str = "bytes"
    vocab_size: int = 257
    eot: int = BYTES_EOT

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8).astype(np.uint32)


@dataclass(frozen=True)
class _Tiktoken:
    spec: str
    vocab_size: int
    eot: int
    name: str

    def encode(self, text: bytes) -> np.ndarray:
        enc = _tiktoken_encoding(self.name)
        ids = enc.encode_ordinary(text.decode("utf-8", errors="replace"))
        return np.asarray(ids, dtype=np.uint32)


@dataclass(frozen=True)
class _HuggingFace:
    spec: str
    vocab_size: int
    eot: int
    name: str

    def encode(self, text: bytes) -> np.ndarray:
        tok = _hf_tokenizer(self.name)
        ids = tok.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.uint32)


def get_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by ``spec``, or a ValueError saying which specs exist."""
    if spec == "bytes":
        return ByteTokenizer()
    kind, _, name = spec.partition(":")
    if kind == "tiktoken" and name:
        enc = _tiktoken_encoding(name)
        return _Tiktoken(spec, enc.n_vocab, enc.eot_token, name)
    if kind == "hf" and name:
        tok = _hf_tokenizer(name)
        return _HuggingFace(spec, tok.get_vocab_size(), _hf_eot(tok, spec), name)
    raise ValueError(
        f"--tokenizer {spec!r} is not known: use 'bytes' (built in), 'tiktoken:NAME' "
        "(e.g. tiktoken:gpt2) or 'hf:FILE_OR_NAME' (a tokenizer.json or a Hub name)"
    )


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """uint16 when every id fits (half the disk and page cache), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _tiktoken_encoding(name: str) -> Any:
    try:
        import tiktoken
    except ImportError:
        raise ValueError(
            f"--tokenizer tiktoken:{name} needs the tiktoken package: pip install tiktoken "
            "(or use --tokenizer bytes)"
        ) from None
    return tiktoken.get_encoding(name)


def _hf_tokenizer(name: str) -> Any:
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise ValueError(
            f"--tokenizer hf:{name} needs the tokenizers package: pip install tokenizers "
            "(or use --tokenizer bytes)"
        ) from None
    try:
        if name.endswith(".json"):
            return HFTokenizer.from_file(name)
        return HFTokenizer.from_pretrained(name)
    except Exception as e:  # the Rust library raises a bare Exception ("No such file ...")
        raise ValueError(
            f"--tokenizer hf:{name} cannot be loaded ({e}); give an existing tokenizer.json "
            "path or a Hub name this machine can download, or use --tokenizer bytes"
        ) from None


def _hf_eot(tok: Any, spec: str) -> int:
    # Models name their end-of-text token differently; take the first one this vocabulary has.
    for candidate in ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>"):
        token_id = tok.token_to_id(candidate)
        if token_id is not None:
            return int(token_id)
    raise ValueError(
        f"--tokenizer {spec}: no end-of-document token found (looked for <|endoftext|>, </s>, "
        "<eos>, [SEP], <|end_of_text|>); documents could not be separated"
    )
