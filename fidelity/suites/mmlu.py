"""MMLU (Hendrycks et al. 2021) as lm-eval's `mmlu_generative` asks it: per subject the description "The following are
multiple choice questions (with answers) about {subject}.", the first `shots` (default 5) questions of the subject's dev
split with their answer letters, then the question, "A. ...\\nB. ...\\nC. ...\\nD. ...\\nAnswer:"; generation stops at a
newline (lm-eval's `until`, sent in both modes).

Metrics, each per item and pooled: "exact_match" = lm-eval's mmlu_generative score (its `get_response` filter: the
reply's first line, whitespace stripped; then exact match ignoring case and punctuation against the letter) = `passed`;
"letter" = our letter extraction for chat answers that say more than the letter: "answer is (B)" / "Answer: B", else a
letter (either case) opening the reply followed by ".", ")", ":", a newline or the end ("B. 4", "(B)", "b."), else None
("A dog" is no answer).

Data: `data=` a jsonl of rows {"subject", "question", "choices": [4 strings], "answer": 0-3 or "A"-"D"}; rows with
"split": "dev" are the few-shot examples (and not items); else `datasets` cais/mmlu "all" (test, and dev for shots).
Item ids: "{subject}/{n}", n counting the subject's test rows from 0."""
from __future__ import annotations

import re

from ..errors import ConfigError
from ..registry import SUITES
from .fewshot import FewshotSuite, chat_messages, exact_match, fewshot_prompt, hub_rows, read_jsonl
from .runner import Item, Outcome

LETTERS = "ABCD"
STOPS = ["</s>", "\n"]
ANSWER_IS = re.compile(r"(?i:answer)(?:\s+is)?\s*[:\-]?\s*\(?([ABCD])\b")
LEADING = re.compile(r"^\s*\(?([A-Da-d])(?=[).:\n]|\s*$)")


def question_text(row: dict) -> str:
    """lm-eval's doc_to_text for MMLU."""
    c = row["choices"]
    return f"{row['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"


def description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def first_line_response(text: str) -> str:
    """lm-eval's mmlu_generative `get_response` filter: up to the first newline, whitespace stripped."""
    return re.match(r"^(.*?)(?=\n|$)", text).group(1).strip()


def extract_letter(text: str) -> str | None:
    text = text.replace("*", "")
    m = ANSWER_IS.search(text) or LEADING.match(text)
    return m.group(1).upper() if m else None


def _letter(answer, where: str) -> str:
    if isinstance(answer, int) and 0 <= answer < 4:
        return LETTERS[answer]
    if isinstance(answer, str) and answer.strip().upper() in LETTERS:
        return answer.strip().upper()
    raise ConfigError(f"mmlu: {where}: answer {answer!r} is neither 0-3 nor A-D")


@SUITES.register("mmlu")
class MMLU(FewshotSuite):
    name = "mmlu"
    prompt = "lm-eval mmlu_generative"
    stops = STOPS

    def _rows(self):
        if self.data:
            rows, source = read_jsonl(self.data, "mmlu", ("subject", "question", "choices", "answer"))
            where = str(self.data)
        else:
            rows, source = hub_rows("mmlu", "cais/mmlu", "all", {"test": "test", "dev": "dev"})
            where = "cais/mmlu"
        for i, r in enumerate(rows):
            if not (isinstance(r["choices"], list) and len(r["choices"]) == 4):
                raise ConfigError(
                    f"mmlu: {where} row {i + 1} (subject {r['subject']!r}) has {len(r['choices'])} choices, not 4"
                )
            r["letter"] = _letter(r["answer"], f"{where} row {i + 1}")
        return rows, source, where

    def _build(self) -> tuple[list[Item], dict]:
        rows, source, where = self._rows()
        dev: dict[str, list[dict]] = {}
        for r in rows:
            if r.get("split") == "dev":
                dev.setdefault(r["subject"], []).append(r)
        items, counts = [], {}
        for r in rows:
            if r.get("split", "test") != "test":
                continue
            subject = r["subject"]
            shots = dev.get(subject, [])[: self.shots]
            if len(shots) < self.shots:
                raise ConfigError(f"mmlu: {where} has {len(shots)} dev rows for subject {subject!r}; --shots "
                                  f"{self.shots} needs that many (or --shots 0)")
            pairs = [(question_text(s), s["letter"]) for s in shots]
            n = counts.get(subject, 0)
            counts[subject] = n + 1
            desc, q = description(subject), question_text(r)
            items.append(Item(f"{subject}/{n}", fewshot_prompt(desc, pairs, q), data={"letter": r["letter"]},
                              messages=chat_messages(desc, pairs, q)))
        return items, source

    def score(self, item: Item, text: str, tool_calls: list) -> Outcome:
        target = item.data["letter"]
        response = first_line_response(text)
        strict = exact_match(response, target, ignore_case=True, ignore_punctuation=True)
        letter = extract_letter(text)
        return Outcome(extracted=response, passed=strict,
                       verdict=f"{'right' if strict else 'wrong'}: {response[:40]!r} vs {target}; letter {letter}",
                       details={"target": target, "letter": letter},
                       metrics={"exact_match": strict, "letter": letter == target})
