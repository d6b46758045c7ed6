"""The tokenizer of a pack, with its chat template: HF tokenizer files for folders, transformers' GGUF tokenizer
support for .gguf files (the chat template comes from the `tokenizer.chat_template` metadata)."""
from __future__ import annotations

import weakref
from pathlib import Path

from ..errors import PackError
from .base import Pack

_CACHE: "weakref.WeakKeyDictionary[Pack, object]" = weakref.WeakKeyDictionary()


def load_tokenizer(pack: Pack):
    """A transformers fast tokenizer for `pack`, loaded once per pack."""
    tok = _CACHE.get(pack)
    if tok is None:
        tok = _CACHE[pack] = _load(pack)
    return tok


def _load(pack: Pack):
    from transformers import AutoTokenizer

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
        _gguf_special_tokens(tok, getattr(pack, "reader", None))
        return tok
    if not any((source / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")):
        raise PackError("no tokenizer files (tokenizer.json / tokenizer.model / vocab.json) in the pack folder", file=source)
    try:
        return AutoTokenizer.from_pretrained(str(source))
    except Exception as e:
        raise PackError(f"transformers cannot load the tokenizer: {type(e).__name__}: {e}", file=source) from None


_GGUF_SPECIALS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                  "pad_token": "padding_token_id"}


def _gguf_special_tokens(tok, reader):
    """BOS/EOS/UNK/PAD as the GGUF's metadata states them: transformers < 5.18 takes EOS from the BOS id and leaves
    PAD unset for byte-level BPE GGUFs (SmolLM2: EOS <|im_start|> instead of <|im_end|>), which write_native and
    write_gguf would then pass on."""
    if reader is None:
        return
    for attr, key in _GGUF_SPECIALS.items():
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is None:
            continue
        token_id = int(field.contents())
        if 0 <= token_id < len(tok) and getattr(tok, f"{attr}_id", None) != token_id:
            setattr(tok, attr, tok.convert_ids_to_tokens(token_id))
