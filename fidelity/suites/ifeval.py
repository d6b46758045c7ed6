"""IFEval (Zhou et al. 2023): verifiable instructions, scored by lm-eval's instruction checkers
(`lm_eval.tasks.ifeval`).

Records: `passed` = prompt-level strict (every instruction followed), `score` = this prompt's fraction of instructions
followed (strict); `details` has the loose variants (the response also tried without its first/last line and without
'*'), as lm-eval computes them. The four official numbers are the record's metrics, named as lm-eval names them:
prompt_level_{strict,loose}_acc (a mean over prompts) and inst_level_{strict,loose}_acc, pooled over all instructions of
all prompts (lm-eval's `agg_inst_level_acc`), not the mean of the per-prompt fractions.

Differences from the official scorer, on purpose, so runs are deterministic and work offline:
- `langdetect` is seeded (DetectorFactory.seed = 0) while a response is checked; the official scorer leaves it unseeded,
  so its language checks can vary from run to run on short or mixed-language answers.
- Python's `random` is seeded with 0 before each response is checked. Two of the 541 prompts (keys 1122 and 1129) ask
  for a "letter" `#` or `!`, which `keywords:letter_frequency` refuses and replaces with a letter drawn at random: the
  official scorer's verdict on that instruction changes from run to run, ours is the same every run (and equals
  lm-eval's when lm-eval's random state is seeded the same way). The checkers draw from the global `random` and read
  langdetect's class attribute (no generator can be handed to them), so both are set for the check alone: the caller's
  random state and langdetect seed are put back after it (`_checkers_seeded`).
- Sentence counting uses nltk's Punkt English model when its data is installed; otherwise (the default offline, where
  the scorer would try `nltk.download("punkt_tab")`) an untrained `PunktSentenceTokenizer`, which knows no English
  abbreviations: "Dr. Smith arrived." counts as two sentences instead of one. Only the
  `length_constraints:number_sentences` instruction uses it. In the same mode `nltk.word_tokenize` (used by
  `change_case:capital_word_frequency`) tokenizes the whole text as one line instead of sentence by sentence: a
  sentence-final period can stay attached to a word ("DONE." is one token), which does not change whether the word is
  all capitals. The manifest records which splitter was used.
- The checkers' modules are loaded straight from lm-eval's files, without importing the rest of lm-eval (which needs its
  full dependency set); the checking code itself is lm-eval's, unchanged.

Data: `data=` a local jsonl in Google's format (key, prompt, instruction_id_list, kwargs), else `datasets`
google/IFEval.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import random
import sys
import types
from pathlib import Path
from unittest import mock

from ..errors import ConfigError
from ..registry import SUITES
from .records import sha256_file
from .runner import Item, Outcome, Suite

_CHECKERS = None


def load_checkers():
    """lm-eval's `instructions_util`, `instructions`, `instructions_registry` and `utils` modules of the ifeval task,
    plus the name of the sentence splitter in use."""
    global _CHECKERS
    if _CHECKERS is not None:
        return _CHECKERS
    import nltk

    spec = importlib.util.find_spec("lm_eval")
    if spec is None:
        raise ConfigError(
            "ifeval needs lm-eval's instruction checkers: pip install --no-deps lm-eval==0.4.13 langdetect "
            "immutabledict nltk (see .ci/install-test-deps)"
        )
    folder = Path(spec.submodule_search_locations[0]) / "tasks" / "ifeval"
    created = []
    for pkg, path in (("lm_eval.tasks", folder.parent), ("lm_eval.tasks.ifeval", folder)):
        if pkg not in sys.modules:  # skip lm_eval/tasks/__init__.py, which imports all of lm-eval
            mod = types.ModuleType(pkg)
            mod.__path__ = [str(path)]
            sys.modules[pkg] = mod
            created.append(pkg)
    mods = {}
    try:
        # no download (offline, and not ours to trigger); the module prints "Downloaded punkt_tab" regardless: hide that
        with mock.patch.object(nltk, "download", lambda *a, **k: False), contextlib.redirect_stdout(io.StringIO()):
            for name in ("instructions_util", "instructions", "instructions_registry", "utils"):
                full = f"lm_eval.tasks.ifeval.{name}"
                if full not in sys.modules:
                    s = importlib.util.spec_from_file_location(full, folder / f"{name}.py")
                    module = importlib.util.module_from_spec(s)
                    sys.modules[full] = module
                    s.loader.exec_module(module)
                mods[name] = sys.modules[full]
    finally:
        for pkg in created:
            sys.modules.pop(pkg, None)
    util = mods["instructions_util"]
    try:
        util._get_sentence_tokenizer().tokenize("One. Two.")
        splitter = "nltk punkt (English model)"
    except (LookupError, OSError, ValueError):
        from nltk.tokenize.punkt import PunktSentenceTokenizer

        local = PunktSentenceTokenizer()
        util._get_sentence_tokenizer = lambda: local
        util.nltk = _OfflineNltk(nltk)  # the checkers reach nltk through this module; the real one stays untouched
        splitter = "untrained PunktSentenceTokenizer (no nltk data)"
    _CHECKERS = (mods, splitter)
    return _CHECKERS


class _OfflineNltk(types.ModuleType):
    """nltk, except `word_tokenize` skips its Punkt sentence split (which needs downloaded data): the Treebank word
    tokenizer then runs over the whole text at once."""

    def __init__(self, real):
        super().__init__("nltk")
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def word_tokenize(self, text, language="english", preserve_line=False):
        return self._real.word_tokenize(text, language=language, preserve_line=True)


@contextlib.contextmanager
def _checkers_seeded():
    """The global `random` seeded with 0 (some checkers fill unspecified arguments at random) and langdetect's
    DetectorFactory.seed 0 for the checks inside, the caller's random state and seed restored after them."""
    import langdetect

    state, seed = random.getstate(), langdetect.DetectorFactory.seed
    random.seed(0)
    langdetect.DetectorFactory.seed = 0
    try:
        yield
    finally:
        random.setstate(state)
        langdetect.DetectorFactory.seed = seed


def score_response(row: dict, response: str) -> Outcome:
    mods, _ = load_checkers()
    utils = mods["utils"]
    inp = utils.InputExample(key=row["key"], instruction_id_list=row["instruction_id_list"], prompt=row["prompt"],
                             kwargs=row["kwargs"])
    with _checkers_seeded():
        strict = utils.test_instruction_following_strict(inp, response)
        loose = utils.test_instruction_following_loose(inp, response)
    followed = strict.follow_instruction_list
    failed = [i for i, ok in zip(row["instruction_id_list"], followed) if not ok]
    loose_followed = loose.follow_instruction_list
    return Outcome(
        extracted=response,
        passed=bool(strict.follow_all_instructions),
        score=sum(followed) / len(followed),
        verdict="all instructions followed" if not failed else "not followed: " + ", ".join(failed),
        details={
            "strict": list(followed),
            "loose": list(loose.follow_instruction_list),
            "prompt_loose": bool(loose.follow_all_instructions),
            "instructions": row["instruction_id_list"],
        },
        metrics={
            "prompt_level_strict_acc": bool(strict.follow_all_instructions),
            "inst_level_strict_acc": (sum(followed), len(followed)),
            "prompt_level_loose_acc": bool(loose.follow_all_instructions),
            "inst_level_loose_acc": (sum(loose_followed), len(loose_followed)),
        },
    )


REQUIRED = ("key", "prompt", "instruction_id_list", "kwargs")


def _check_rows(rows: list[dict], where: str):
    for i, r in enumerate(rows):
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            raise ConfigError(f"ifeval: {where} row {i + 1} (key {r.get('key')!r}) lacks {missing}")
        if len(r["instruction_id_list"]) != len(r["kwargs"]):
            raise ConfigError(f"ifeval: {where} row {i + 1} (key {r['key']!r}) has {len(r['instruction_id_list'])} "
                              f"instructions but {len(r['kwargs'])} kwargs")


@SUITES.register("ifeval")
class IFEval(Suite):
    name = "ifeval"
    metric = "passed"
    default_max_tokens = 1280

    def __init__(self, data: str | None = None):
        self.data = data
        self._rows = None
        self._source = None

    def rows(self) -> list[dict]:
        if self._rows is None:
            if self.data:
                path = Path(self.data)
                if not path.exists():
                    raise ConfigError(f"ifeval: data file {path} does not exist")
                rows = []
                for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as e:
                            raise ConfigError(f"ifeval: {path} line {lineno} is not JSON ({e})")
                self._source = {"source": f"local:{path}", "sha256": sha256_file(path), "prompts": len(rows)}
                where = str(path)
            else:
                try:
                    import datasets

                    ds = datasets.load_dataset("google/IFEval", split="train")
                except Exception as e:  # offline, or no `datasets`
                    raise ConfigError(
                        f"ifeval: cannot load google/IFEval ({type(e).__name__}: {str(e)[:200]}); pass a local "
                        f"input_data.jsonl with --data"
                    )
                rows = [dict(r) for r in ds]
                blob = "\n".join(json.dumps(r, sort_keys=True) for r in rows).encode()
                self._source = {
                    "source": "hf:google/IFEval",
                    "sha256": hashlib.sha256(blob).hexdigest(),
                    "prompts": len(rows),
                }
                where = "google/IFEval"
            _check_rows(rows, where)
            for r in rows:  # the HF copy fills absent arguments with None; the checkers want them absent
                r["kwargs"] = [{k: v for k, v in kw.items() if v is not None} for kw in r["kwargs"]]
            self._rows = {str(r["key"]): r for r in rows}
        return list(self._rows.values())

    def source(self) -> dict:
        self.rows()
        return self._source

    def config(self) -> dict:
        return {"sentence_splitter": load_checkers()[1], "langdetect_seed": 0}

    def load(self) -> list[Item]:
        return [Item(str(r["key"]), r["prompt"], data={"key": r["key"]}) for r in self.rows()]

    def score(self, item: Item, text: str, tool_calls: list) -> Outcome:
        return score_response(self._rows[item.item_id], text)
