"""The tokenizer of a pack, with its chat template: HF tokenizer files for folders, transformers' GGUF tokenizer
support for .gguf files (the chat template comes from the `tokenizer.chat_template` metadata)."""
from __future__ import annotations

import weakref
from pathlib import Path

from ..errors import PackError
from .base import Pack
from .opening import open_pack

_CACHE: "weakref.WeakKeyDictionary[Pack, object]" = weakref.WeakKeyDictionary()


def load_tokenizer(pack: Pack):
    """A transformers fast tokenizer for `pack`, loaded once per pack."""
    tok = _CACHE.get(pack)
    if tok is None:
        tok = _CACHE[pack] = _load(pack)
    return tok


def tokenizer_of(pack_or_path):
    """`load_tokenizer` of a Pack, or of the pack at a path (opened here)."""
    return load_tokenizer(pack_or_path if hasattr(pack_or_path, "names") else open_pack(pack_or_path))


def _load(pack: Pack):
    from transformers import AutoTokenizer  # noqa: PLC0415 (transformers: ~1 s, loaded on use)

    source = pack.tokenizer_source()
    if source is None:
        raise PackError("this pack has no tokenizer source (no tokenizer files, not a GGUF)", file=pack.path)
    source = Path(source)
    if source.is_file() and source.suffix == ".gguf":
        try:
            tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        except Exception as e:
            raise PackError(f"transformers cannot build a tokenizer from this GGUF: {type(e).__name__}: {e}",
                            file=source) from None
        template = getattr(pack, "metadata_chat_template", None)
        if template and not tok.chat_template:
            tok.chat_template = template
        return tok
    if not any(
        (source / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    ):
        raise PackError(
            "no tokenizer files (tokenizer.json / tokenizer.model / vocab.json) in the pack folder", file=source
        )
    try:
        return AutoTokenizer.from_pretrained(str(source))
    except Exception as e:
        raise PackError(f"transformers cannot load the tokenizer: {type(e).__name__}: {e}", file=source) from None
