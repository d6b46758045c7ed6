"""MMLU and GSM8K: prompts and scoring against lm-eval's own templates (its task YAML rendered with jinja2, its
`build_qa_turn` / `Message` layout), its regex filters and exact_match, on small hand-written local copies; the hub path
with `datasets` stood in; the runner's pooled metrics on them against numpy."""
import asyncio
import importlib.util
import json
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fidelity.errors import ConfigError
from fidelity.suites import make_suite
from fidelity.suites.paired import compare_runs
from fidelity.suites.runner import Settings, run_suite

MATH, RELIGIONS = "high_school_mathematics", "world_religions"
MMLU_ROWS = [
    {"subject": MATH, "split": "dev", "question": "What is 2 + 2?", "choices": ["3", "4", "5", "6"], "answer": 1},
    {"subject": MATH, "split": "dev", "question": " Which is prime? ", "choices": ["4", "6", "7", "9"], "answer": 2},
    {"subject": MATH, "question": "What is 3 * 3?", "choices": ["6", "9", "12", "33"], "answer": 1},
    {"subject": MATH, "question": "What is 10 / 2?", "choices": ["5", "2", "20", "8"], "answer": "A"},
    {"subject": RELIGIONS, "split": "dev", "question": "Where is Mecca?",
     "choices": ["Iraq", "Egypt", "Saudi Arabia", "Jordan"], "answer": 2},
    {"subject": RELIGIONS, "split": "dev", "question": "The Torah is sacred in",
     "choices": ["Judaism", "Jainism", "Shinto", "Sikhism"], "answer": 0},
    {"subject": RELIGIONS, "question": "The Vedas belong to", "choices": ["Islam", "Hinduism", "Taoism", "Bahai"],
     "answer": 1},
    {"subject": RELIGIONS, "question": "Zen is a school of", "choices": ["Buddhism", "Islam", "Judaism", "Jainism"],
     "answer": 0},
    {"subject": RELIGIONS, "question": "Who founded Sikhism?", "choices": ["Mahavira", "Laozi", "Moses", "Guru Nanak"],
     "answer": 3},
]

GSM8K_ROWS = [
    {"split": "train", "question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"split": "train", "question": "A box holds 12 eggs. How many eggs are in 5 boxes?",
     "answer": "5 boxes hold 5 * 12 = <<5*12=60>>60 eggs.\n#### 60"},
    {"split": "train", "question": "Ann earns $1,200 a week. What does she earn in 2 weeks?",
     "answer": "She earns 2 * 1200 = <<2*1200=2400>>2400 dollars.\n#### 2,400"},
    {"question": "Sam reads 20 pages a day. How many pages in 7 days?", "answer": "20 * 7 = <<20*7=140>>140\n#### 140"},
    {"question": "A pen costs $3. How much do 15 pens cost?", "answer": "15 * 3 = <<15*3=45>>45\n#### 45"},
    {"question": "Lia had 50 stickers and gave away 18. How many are left?",
     "answer": "50 - 18 = <<50-18=32>>32\n#### 32"},
    {"question": "A farm has 1200 cows and sells 250. How many remain?", "answer": "1200 - 250 = 950\n#### 950"},
    {"question": "The temperature fell from 5 to -3 degrees. What is the final temperature?", "answer": "#### -3"},
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lm_eval_folder() -> Path:
    spec = importlib.util.find_spec("lm_eval")
    if spec is None:
        pytest.skip("missing tool: lm-eval is not installed")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture
def lm_eval_task(monkeypatch):
    """lm-eval's `ConfigurableTask` and its `api.utils`; lm-eval installed --no-deps lacks sacrebleu, which only its
    metrics module imports at the top and nothing here calls."""
    lm_eval_folder()
    if importlib.util.find_spec("sacrebleu") is None:
        monkeypatch.setitem(sys.modules, "sacrebleu", types.ModuleType("sacrebleu"))
    try:
        from lm_eval.api import utils
        from lm_eval.api.task import ConfigurableTask
    except ImportError as e:
        pytest.skip(f"missing tool: lm-eval's task module does not import here: {e}")
    return ConfigurableTask, utils


def lm_eval_yaml(*parts) -> dict:
    import yaml

    return yaml.safe_load((lm_eval_folder() / "tasks" / Path(*parts)).read_text())


def lm_eval_context(task_cls, utils, description, shots, question):
    """lm-eval's fewshot_context without / with a chat template (not multiturn), from its own pieces."""
    messages = [utils.Message("system", description)] if description else []
    for q, a in shots:
        messages += task_cls.build_qa_turn(None, q=q, a=a, tgt_delim=" ", few_delim="\n\n")
    messages += task_cls.build_qa_turn(None, q=question, tgt_delim=" ", few_delim="")
    text = "".join(m.to_text() for m in messages)
    return text, utils.multiturn_to_singleturn(messages)


def test_mmlu_prompts_equal_lm_eval_fewshot_context(tmp_path, lm_eval_task):
    import jinja2

    task_cls, utils = lm_eval_task
    template = lm_eval_yaml("mmlu", "generative", "_default_template_yaml")
    assert template["fewshot_config"]["sampler"] == "first_n" and template["fewshot_split"] == "dev"
    env = jinja2.Environment()
    text_t, target_t = env.from_string(template["doc_to_text"]), env.from_string(template["doc_to_target"])
    suite = make_suite("mmlu", data=str(write_jsonl(tmp_path / "mmlu.jsonl", MMLU_ROWS)), shots=2)
    items = suite.load()
    tests = [r for r in MMLU_ROWS if r.get("split") != "dev"]
    assert [it.item_id for it in items] == [
        "high_school_mathematics/0",
        "high_school_mathematics/1",
        "world_religions/0",
        "world_religions/1",
        "world_religions/2",
    ]
    for item, row in zip(items, tests):
        subject_yaml = lm_eval_yaml("mmlu", "generative", f"mmlu_{row['subject']}.yaml")
        dev = [r for r in MMLU_ROWS if r.get("split") == "dev" and r["subject"] == row["subject"]][:2]
        norm = lambda r: {**r, "answer": "ABCD".index(r["answer"]) if isinstance(r["answer"], str) else r["answer"]}
        shots = [(text_t.render(**norm(r)), target_t.render(**norm(r))) for r in dev]
        text, chat = lm_eval_context(task_cls, utils, subject_yaml["description"], shots, text_t.render(**norm(row)))
        assert item.prompt == text
        assert item.messages == chat
        assert item.data["letter"] == target_t.render(**norm(row))
    assert suite.stop(Settings()) == template["generation_kwargs"]["until"]
    zero = make_suite("mmlu", data=str(tmp_path / "mmlu.jsonl"), shots=0).load()[0]
    assert zero.prompt == lm_eval_context(task_cls, utils, lm_eval_yaml("mmlu", "generative",
                                          "mmlu_high_school_mathematics.yaml")["description"], [],
                                          text_t.render(**MMLU_ROWS[2]))[0]


def test_gsm8k_prompts_equal_lm_eval_fewshot_context(tmp_path, lm_eval_task):
    import jinja2

    task_cls, utils = lm_eval_task
    cfg = lm_eval_yaml("gsm8k", "gsm8k.yaml")
    env = jinja2.Environment()
    text_t, target_t = env.from_string(cfg["doc_to_text"]), env.from_string(cfg["doc_to_target"])
    suite = make_suite("gsm8k", data=str(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)), shots=3)
    items = suite.load()
    train = [r for r in GSM8K_ROWS if r.get("split") == "train"]
    tests = [r for r in GSM8K_ROWS if r.get("split") != "train"]
    assert len(items) == len(tests) and items[0].item_id == "gsm8k/0"
    shots = [(text_t.render(**r), target_t.render(**r)) for r in train[:3]]
    for item, row in zip(items, tests):
        text, chat = lm_eval_context(task_cls, utils, "", shots, text_t.render(**row))
        assert item.prompt == text and item.messages == chat
    assert suite.stop(Settings()) == cfg["generation_kwargs"]["until"]
    assert make_suite("gsm8k", data=str(tmp_path / "gsm8k.jsonl")).shots == cfg["num_fewshot"]


def gsm8k_replies(rng: random.Random, answer_number: str) -> list[str]:
    wrong = str(int(answer_number.replace(",", "")) + rng.randrange(1, 9))
    n = answer_number
    return [f"The total is {n}.\n#### {n}", f"So {n}", f"#### ${n}.", f"#### {wrong}", f"{n} then {wrong}",
            f"It is {wrong}. Answer: {n}.", f"#### {n[:1]},{n[1:]}" if len(n) > 1 else f"#### {n}", "I do not know.",
            f"${int(n.replace(',', '')):,}", f"#### {n} dollars and 5 cents", f"{n}.0", f"-{n}", ""]


def test_gsm8k_scoring_equals_lm_eval_filters_and_exact_match(tmp_path, lm_eval_task, rng_seed):
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    cfg = lm_eval_yaml("gsm8k", "gsm8k.yaml")
    filters = {f["name"]: f["filter"][0] for f in cfg["filter_list"]}
    metric = cfg["metric_list"][0]
    kw = {k: metric[k] for k in ("regexes_to_ignore", "ignore_case", "ignore_punctuation")}
    strict_f = RegexFilter(filters["strict-match"]["regex_pattern"])
    flexible_f = RegexFilter(
        filters["flexible-extract"]["regex_pattern"], group_select=filters["flexible-extract"]["group_select"]
    )
    suite = make_suite("gsm8k", data=str(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)), shots=3)
    rng = random.Random(rng_seed)
    checked = {"strict-match": [], "flexible-extract": []}
    for item in suite.load():
        number = item.data["answer"].split("#### ")[-1]
        for reply in gsm8k_replies(rng, number):
            out = suite.score(item, reply, [])
            for name, f in (("strict-match", strict_f), ("flexible-extract", flexible_f)):
                pred = f.apply([[reply]], [None])[0][0]
                ref = bool(exact_match_hf_evaluate([pred], [item.data["answer"]], **kw)["exact_match"])
                assert out.metrics[name] == ref, (name, reply, pred)
                checked[name].append(ref)
            assert out.passed == out.metrics["strict-match"]
    assert all(any(v) and not all(v) for v in checked.values())  # both outcomes exercised


def test_mmlu_scoring_equals_lm_eval_get_response_and_extracts_letters(tmp_path, lm_eval_task):
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter, WhitespaceFilter

    template = lm_eval_yaml("mmlu", "generative", "_default_template_yaml")
    steps = template["filter_list"][0]["filter"]
    assert [s["function"] for s in steps] == ["regex", "remove_whitespace", "regex", "take_first"]
    pipeline = [RegexFilter(steps[0]["regex_pattern"]), WhitespaceFilter(), RegexFilter(steps[2]["regex_pattern"])]
    metric = template["metric_list"][0]
    suite = make_suite("mmlu", data=str(write_jsonl(tmp_path / "mmlu.jsonl", MMLU_ROWS)), shots=0)
    item = suite.load()[0]  # answer B
    cases = {
        "B": "B",
        " B\nbecause 9": "B",
        "b.": "B",
        "(B)": "B",
        "B) 9": "B",
        "The answer is (B).": "B",
        "Answer: B": "B",
        "**B**": "B",
        "C": "C",
        "A dog": None,
        "9": None,
        "": None,
        "The answer is C, not B": "C",
        "B\n": "B",
        "  D  ": "D",
    }
    for reply, letter in cases.items():
        out = suite.score(item, reply, [])
        resps = [[reply]]
        for f in pipeline:
            resps = f.apply(resps, [None])
        ref = bool(exact_match_hf_evaluate([resps[0][0]], ["B"], ignore_case=metric["ignore_case"],
                                           ignore_punctuation=metric["ignore_punctuation"])["exact_match"])
        assert out.metrics["exact_match"] == ref == out.passed, reply
        assert out.details["letter"] == letter and out.metrics["letter"] == (letter == "B"), reply


class Replier:
    """Answers the item's own gold answer for every other item, a wrong one otherwise."""

    def __init__(self, answers):
        self.answers = answers

    async def completion(self, prompt, tag="", **kw):
        i = int(tag.rsplit("/", 1)[1])
        text = self.answers(i)
        return SimpleNamespace(text=text, finish_reason="length" if i % 3 == 0 else "stop")


def test_gsm8k_runs_pool_and_compare_against_numpy(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    tests = [r for r in GSM8K_ROWS if r.get("split") != "train"]
    gold = [r["answer"].split("#### ")[-1] for r in tests]
    replies_a = [f"Work.\n#### {g}" if i % 2 == 0 else f"so {g}" for i, g in enumerate(gold)]
    replies_b = [f"#### {g}" if i < 2 else "#### 0" for i, g in enumerate(gold)]
    for name, replies in (("a", replies_a), ("b", replies_b)):
        asyncio.run(run_suite(make_suite("gsm8k", data=str(path), shots=2), tmp_path / name, engine="e", model="m",
                              client=Replier(lambda i, r=replies: r[i]), settings=Settings(mode="completion")))
    strict_a = np.array([i % 2 == 0 for i in range(len(gold))])
    flexible_a = np.ones(len(gold), bool)
    strict_b = np.array([i < 2 for i in range(len(gold))])
    rep = compare_runs(tmp_path / "a", tmp_path / "b")
    assert rep["metrics"]["strict-match"]["rate_a"] == strict_a.mean()
    assert rep["metrics"]["flexible-extract"]["rate_a"] == flexible_a.mean()
    assert rep["metrics"]["strict-match"]["rate_b"] == rep["metrics"]["flexible-extract"]["rate_b"] == strict_b.mean()
    assert rep["cut_by_limit"]["a"] == sum(i % 3 == 0 for i in range(len(gold)))
    assert rep["metrics"]["flexible-extract"]["flips_a_to_b"] == int((flexible_a & ~strict_b).sum())


def test_hub_path_and_offline_message(monkeypatch):
    import datasets

    hub = {
        ("cais/mmlu", "all", "test"): [dict(MMLU_ROWS[2])],
        ("cais/mmlu", "all", "dev"): [dict(MMLU_ROWS[0])],
        ("openai/gsm8k", "main", "test"): [dict(GSM8K_ROWS[3])],
        ("openai/gsm8k", "main", "train"): [dict(GSM8K_ROWS[0])],
    }
    for r in hub.values():
        r[0].pop("split", None)
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name, split: hub[(path, name, split)])
    mmlu = make_suite("mmlu", shots=1)
    (item,) = mmlu.load()
    assert mmlu.source()["source"] == "hf:cais/mmlu/all" and len(mmlu.source()["sha256"]) == 64
    assert item.prompt.count("Answer:") == 2 and item.prompt.endswith("C. 12\nD. 33\nAnswer:")
    gsm = make_suite("gsm8k", shots=1)
    (item,) = gsm.load()
    assert gsm.source()["source"] == "hf:openai/gsm8k/main" and item.prompt.startswith("Question: Tom has 3 apples")

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match="mmlu: cannot load cais/mmlu .*--data"):
        make_suite("mmlu").load()
    with pytest.raises(ConfigError, match="gsm8k: cannot load openai/gsm8k .*--data"):
        make_suite("gsm8k").load()


def test_bad_local_data_names_the_line_or_subject(tmp_path):
    bad = write_jsonl(tmp_path / "m.jsonl", [{"subject": "x", "question": "q", "choices": ["a", "b"]}])
    with pytest.raises(ConfigError, match=r"m\.jsonl line 1 lacks \['answer'\]"):
        make_suite("mmlu", data=str(bad)).load()
    write_jsonl(bad, [{"subject": "x", "question": "q", "choices": ["a", "b"], "answer": 0}])
    with pytest.raises(ConfigError, match=r"m\.jsonl row 1 \(subject 'x'\) has 2 choices"):
        make_suite("mmlu", data=str(bad)).load()
    write_jsonl(bad, [{"subject": "x", "question": "q", "choices": list("abcd"), "answer": "E"}])
    with pytest.raises(ConfigError, match=r"m\.jsonl row 1: answer 'E'"):
        make_suite("mmlu", data=str(bad)).load()
    write_jsonl(bad, MMLU_ROWS)
    with pytest.raises(ConfigError, match="2 dev rows for subject 'high_school_mathematics'; --shots 5"):
        make_suite("mmlu", data=str(bad)).load()
    g = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "42"}])
    with pytest.raises(ConfigError, match=r"g\.jsonl row 1: the answer has no '#### N'"):
        make_suite("gsm8k", data=str(g), shots=0).load()
    write_jsonl(g, GSM8K_ROWS)
    with pytest.raises(ConfigError, match="3 train rows; --shots 5"):
        make_suite("gsm8k", data=str(g)).load()
    with pytest.raises(ConfigError, match="does not exist"):
        make_suite("gsm8k", data=str(tmp_path / "none.jsonl")).load()
