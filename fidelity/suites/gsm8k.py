"""GSM8K (Cobbe et al. 2021) as lm-eval's `gsm8k` task asks and scores it: the first `shots` (default 5) training
problems with their worked answers ("... #### 72") as "Question: ...\\nAnswer: ...", then "Question:
{question}\\nAnswer:"; generation stops at "Question:", "</s>" or "<|im_end|>" (sent in both modes).

Metrics, each per item and pooled, named as lm-eval names its filters: "strict-match" = the number after "#### "
(lm-eval's regex `#### (\\-?[0-9\\.\\,]+)`, first match) = `passed`; "flexible-extract" = the last number in the reply
(regex `(-?[$0-9.,]{2,})|(-?[0-9]+)`, last match). Both are compared with lm-eval's exact_match normalization: ",", "$",
everything up to "#### " and a final "." removed from reply and reference, case ignored.

Data: `data=` a jsonl of rows {"question", "answer"} (answer in GSM8K's form, ending "#### N"); rows with "split":
"train" are the few-shot examples (and not items); else `datasets` openai/gsm8k "main" (test, and train for shots).
Item ids: "gsm8k/{n}", n counting the test rows from 0."""
from __future__ import annotations

import re

from ..errors import ConfigError
from ..registry import SUITES
from .fewshot import FewshotSuite, chat_messages, exact_match, fewshot_prompt, hub_rows, read_jsonl, regex_extract
from .runner import Item, Outcome

STOPS = ["Question:", "</s>", "<|im_end|>"]
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORE = [",", "\\$", "(?s).*#### ", "\\.$"]


def question_text(row: dict) -> str:
    return f"Question: {row['question']}\nAnswer:"


def is_correct(prediction: str, answer: str) -> bool:
    return exact_match(prediction, answer, regexes_to_ignore=IGNORE, ignore_case=True)


@SUITES.register("gsm8k")
class GSM8K(FewshotSuite):
    name = "gsm8k"
    prompt = "lm-eval gsm8k"
    stops = STOPS

    def _build(self) -> tuple[list[Item], dict]:
        if self.data:
            rows, source = read_jsonl(self.data, "gsm8k", ("question", "answer"))
            where = str(self.data)
        else:
            rows, source = hub_rows("gsm8k", "openai/gsm8k", "main", {"test": "test", "train": "train"})
            where = "openai/gsm8k"
        for i, r in enumerate(rows):
            if not STRICT.search(r["answer"]):
                raise ConfigError(f"gsm8k: {where} row {i + 1}: the answer has no '#### N' final line")
        train = [r for r in rows if r.get("split") == "train"][: self.shots]
        if len(train) < self.shots:
            raise ConfigError(f"gsm8k: {where} has {len(train)} train rows; --shots {self.shots} needs that many "
                              f"(or --shots 0)")
        pairs = [(question_text(r), r["answer"]) for r in train]
        test = [r for r in rows if r.get("split", "test") == "test"]
        return [Item(f"gsm8k/{n}", fewshot_prompt("", pairs, question_text(r)), data={"answer": r["answer"]},
                     messages=chat_messages("", pairs, question_text(r))) for n, r in enumerate(test)], source

    def score(self, item: Item, text: str, tool_calls: list) -> Outcome:
        answer = item.data["answer"]
        strict = regex_extract(STRICT, text)
        flexible = regex_extract(FLEXIBLE, text, group_select=-1)
        ok_strict, ok_flexible = is_correct(strict, answer), is_correct(flexible, answer)
        target = re.sub("(?s).*#### ", "", answer)
        return Outcome(extracted=strict, passed=ok_strict,
                       verdict=f"strict {strict!r}, flexible {flexible!r} vs {target!r}",
                       details={"strict": strict, "flexible": flexible, "target": target},
                       metrics={"strict-match": ok_strict, "flexible-extract": ok_flexible})
