"""What MMLU and GSM8K share: lm-eval's few-shot prompt layout, its `exact_match` normalization, their data loading
(a local jsonl or the Hugging Face hub through `datasets`) and their suite's frame (`FewshotSuite`).

lm-eval (0.4, `ConfigurableTask.fewshot_context` without a chat template) writes a prompt as
  description + (shot question + " " + shot answer + "\n\n") for each shot + question,
the shots being the first N of the few-shot split ("first_n" sampler). With a chat template and without
--fewshot_as_multiturn it sends the description as a system message and the rest as one user message; `chat_messages`
does the same."""
from __future__ import annotations

import hashlib
import json
import re
import string
from pathlib import Path

from ..errors import ConfigError
from .records import sha256_file
from .runner import Item, Suite

TARGET_DELIMITER, FEWSHOT_DELIMITER = " ", "\n\n"


def fewshot_prompt(description: str, shots: list[tuple[str, str]], question: str) -> str:
    return description + "".join(q + TARGET_DELIMITER + a + FEWSHOT_DELIMITER for q, a in shots) + question


def chat_messages(description: str, shots: list[tuple[str, str]], question: str) -> list[dict]:
    user = {"role": "user", "content": fewshot_prompt("", shots, question)}
    return [{"role": "system", "content": description}, user] if description else [user]


def exact_match(
    prediction: str, reference: str, *, regexes_to_ignore=(), ignore_case=False, ignore_punctuation=False
) -> bool:
    """lm-eval's `exact_match` (HF evaluate's): each regex removed from both sides in order, then lower case, then ASCII
    punctuation removed; no whitespace stripping."""
    for pattern in regexes_to_ignore:
        prediction, reference = re.sub(pattern, "", prediction), re.sub(pattern, "", reference)
    if ignore_case:
        prediction, reference = prediction.lower(), reference.lower()
    if ignore_punctuation:
        table = str.maketrans("", "", string.punctuation)
        prediction, reference = prediction.translate(table), reference.translate(table)
    return prediction == reference


def regex_extract(pattern: re.Pattern, text: str, group_select: int = 0, fallback: str = "[invalid]") -> str:
    """lm-eval's "regex" filter: the `group_select`-th of all matches (for alternatives, the first group that matched),
    stripped; `fallback` when nothing matches."""
    found = pattern.findall(text)
    if not found:
        return fallback
    match = found[group_select]
    if isinstance(match, tuple):
        match = next((m for m in match if m), fallback)
    return match.strip()


def read_jsonl(path: str | Path, suite: str, required: tuple[str, ...]) -> tuple[list[dict], dict]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{suite}: data file {path} does not exist")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{suite}: {path} line {lineno} is not JSON ({e})")
        missing = [k for k in required if k not in row]
        if missing:
            raise ConfigError(f"{suite}: {path} line {lineno} lacks {missing}")
        rows.append(row)
    return rows, {"source": f"local:{path}", "sha256": sha256_file(path), "rows": len(rows)}


def hub_rows(suite: str, path: str, name: str, splits: dict[str, str]) -> tuple[list[dict], dict]:
    """Rows of `datasets.load_dataset(path, name)`'s splits, each row tagged with "split" = the key of `splits`."""
    try:
        import datasets

        rows = []
        for tag, split in splits.items():
            rows += [{**dict(r), "split": tag} for r in datasets.load_dataset(path, name, split=split)]
    except Exception as e:  # offline, or no `datasets`
        raise ConfigError(
            f"{suite}: cannot load {path} ({type(e).__name__}: {str(e)[:200]}); pass a local jsonl with --data"
        )
    blob = "\n".join(json.dumps(r, sort_keys=True) for r in rows).encode()
    return rows, {"source": f"hf:{path}/{name}", "sha256": hashlib.sha256(blob).hexdigest(), "rows": len(rows)}


class FewshotSuite(Suite):
    """An lm-eval generative few-shot task: `shots` examples from the data's own few-shot split, the task's stop
    strings sent in both modes. Subclasses set `name`, `prompt` (lm-eval's task, for the manifest), `stops`, and
    build their items and data source in `_build()`."""

    metric = "passed"
    default_max_tokens = 256  # lm-eval's max_gen_toks
    prompt = "?"
    stops: list[str] = []

    def __init__(self, data: str | None = None, shots: int = 5):
        if shots < 0:
            raise ConfigError(f"{self.name}: shots must be >= 0, not {shots}")
        self.data, self.shots = data, shots
        self._items = None
        self._source = None

    def _build(self) -> tuple[list[Item], dict]:
        raise NotImplementedError

    def load(self) -> list[Item]:
        if self._items is None:
            self._items, self._source = self._build()
        return self._items

    def source(self) -> dict:
        self.load()
        return self._source

    def config(self) -> dict:
        return {"shots": self.shots, "prompt": self.prompt, "stop": self.stops}

    def stop(self, settings):
        return self.stops
