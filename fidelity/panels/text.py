"""Fixed-length token rows cut from text, the way llama.cpp's perplexity tool and exllamav3's model_diff make their
sets: the source's documents are tokenized one after another (each followed by a blank line), the token stream is cut
into rows of exactly N tokens, and every token after a row's first is scored. Rows are token-exact, so the cut stays
where it was made whatever the tokenizer would do with the text at a row's edges.

Sources: a .txt file (one document), .jsonl / .parquet (one document per record, the `field` column), or
`hf:NAME[:SPLIT]` (`datasets.load_dataset(NAME, split=SPLIT)`, a hub id or a local folder of data files). Several
sources make several domains of one panel.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pyarrow.parquet as pq

from .panel import Panel, PanelError, PanelRow, iter_jsonl, tokenizer_fingerprint, write_panel

SEPARATOR = "\n\n"


def iter_documents(source: str, field: str = "text") -> Iterator[str]:
    """The texts of one source, in order; empty ones skipped."""
    if source.startswith("hf:"):
        name, _, split = source[3:].partition(":")
        try:
            import datasets
        except ImportError:
            raise PanelError("hf: sources need the `datasets` package (pip install datasets)") from None
        try:
            ds = datasets.load_dataset(name, split=split or "train")
        except Exception as e:
            raise PanelError(
                f"datasets cannot load {name!r} (split {split or 'train'!r}): {type(e).__name__}: {e}"
            ) from None
        if field not in ds.column_names:
            raise PanelError(
                f"{source}: no field {field!r} (fields: {', '.join(ds.column_names)}); choose one with --field"
            )
        for i, rec in enumerate(ds):
            yield _text(rec.get(field), f"{source} row {i}", field)
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise PanelError(f"{path}: no such text source")
    if path.suffix == ".txt":
        yield path.read_text(encoding="utf-8")
    elif path.suffix == ".jsonl":
        for n, obj in iter_jsonl(path):
            if not isinstance(obj, dict) or field not in obj:
                raise PanelError(f"{path} line {n}: no field {field!r}; choose the text field with --field")
            yield _text(obj[field], f"{path} line {n}", field)
    elif path.suffix == ".parquet":
        table = pq.read_table(path)
        if field not in table.column_names:
            raise PanelError(
                f"{path}: no column {field!r} (columns: {', '.join(table.column_names)}); choose one with --field"
            )
        for i, value in enumerate(table.column(field).to_pylist()):
            yield _text(value, f"{path} row {i}", field)
    else:
        raise PanelError(f"{path}: a text source is .txt, .jsonl, .parquet or hf:NAME[:SPLIT]")


def _text(value, where: str, field: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise PanelError(f"{where}: field {field!r} is {type(value).__name__}, not text")
    return value


def token_rows(source: str, tokenizer, *, tokens_per_row: int, rows: int, domain: str, field: str = "text",
               bos: bool = False) -> list[PanelRow]:
    """`rows` rows of exactly `tokens_per_row` tokens from the start of `source` (with `bos`, each row is the BOS
    token followed by tokens_per_row - 1 text tokens)."""
    if tokens_per_row < 2 or rows < 1:
        raise PanelError(f"--tokens-per-row must be at least 2 and --rows at least 1, got {tokens_per_row} and {rows}")
    bos_id = tokenizer.bos_token_id if bos else None
    if bos and bos_id is None:
        raise PanelError("--bos: the pack's tokenizer has no BOS token")
    per_row = tokens_per_row - (1 if bos else 0)
    need = per_row * rows
    stream: list[int] = []
    for text in iter_documents(source, field):
        if text.strip():
            stream += tokenizer(text + SEPARATOR, add_special_tokens=False)["input_ids"]
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise PanelError(f"{source}: {len(stream)} tokens make only {len(stream) // per_row} rows of {tokens_per_row} "
                         f"tokens; {rows} asked")
    out = []
    for i in range(rows):
        chunk = ([bos_id] if bos else []) + stream[i * per_row:(i + 1) * per_row]
        out.append(PanelRow(f"{domain}-{i:04d}", domain, tokens=chunk, scored=[False] + [True] * (tokens_per_row - 1)))
    return out


def panel_from_text(sources: list[str], pack, out: str | Path, *, tokens_per_row: int, rows: int,
                    domains: list[str] | None = None, field: str = "text", bos: bool = False, name: str | None = None,
                    description: str = "", license: str = "see the source", tokenizer=None) -> Panel:
    """One domain per source. `pack`: a path or Pack whose tokenizer cuts the rows (or pass `tokenizer`)."""
    if tokenizer is None:
        # the packs load torch: only without a tokenizer
        from ..packs.tokenizer import tokenizer_of  # noqa: PLC0415 (torch)

        tokenizer = tokenizer_of(pack)
    if domains and len(domains) != len(sources):
        raise PanelError(f"{len(sources)} sources but {len(domains)} --domain names: give one per source, in order")
    domains = domains or [Path(s.split(":")[1] if s.startswith("hf:") else s).stem.replace("/", "_") for s in sources]
    if len(set(domains)) != len(domains):
        raise PanelError(f"two sources have the same domain ({', '.join(domains)}); name them with --domain")
    all_rows = []
    for source, domain in zip(sources, domains):
        all_rows += token_rows(source, tokenizer, tokens_per_row=tokens_per_row, rows=rows, domain=domain, field=field,
                               bos=bos)
    srcs = [{"part": d, "source": s, "field": field, "license": license} for s, d in zip(sources, domains)]
    cut = {"tokens_per_row": tokens_per_row, "rows_per_source": rows, "bos": bos, "separator": SEPARATOR,
           "tokenizer": tokenizer_fingerprint(tokenizer)}
    return write_panel(out, all_rows, name=name or Path(out).name, sources=srcs,
                       description=description or f"{rows} rows x {tokens_per_row} tokens per source, cut from text",
                       extra={"from_text": cut})
