"""Text that UTF-8 cannot carry, written anyway: a lone surrogate (half of a UTF-16 pair, e.g. the "\\ud800" escape an
engine's JSON reply may hold, which json.loads turns into a Python str no UTF-8 encoder accepts).

JSON holding such a string is written with \\uXXXX escapes (`json_bytes`), which json.loads reads back to the same str;
every other JSON is written as before, its non-ASCII text as itself. Identity hashes take `hash_bytes`: UTF-8 on every
valid text (so existing hashes stay), and on a lone surrogate its 'surrogatepass' bytes, which no valid text encodes
to, so two different strings never hash alike."""
from __future__ import annotations

import json


def first_lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text`, None when it has none (UTF-8 encodes every other str)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def json_bytes(obj, **dumps_kwargs) -> tuple[bytes, bool]:
    """(UTF-8 JSON of `obj`, escaped): non-ASCII text as itself, unless a string in `obj` holds a lone surrogate; then
    the whole text in \\uXXXX escapes (ensure_ascii) and `escaped` True, so a writer can record that it happened."""
    try:
        return json.dumps(obj, ensure_ascii=False, **dumps_kwargs).encode("utf-8"), False
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, **dumps_kwargs).encode("ascii"), True


def hash_bytes(text: str) -> bytes:
    """The bytes an identity hash of `text` is taken over (see the module docstring)."""
    return text.encode("utf-8", "surrogatepass")
