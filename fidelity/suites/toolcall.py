"""Tool calling: BFCL v3's single-turn categories from PyPI `bfcl-eval` (2026.3.23), sent as OpenAI `tools` the way BFCL
sends them to a function-calling model, judged by BFCL's own checkers, with per-category results.

Categories (`V3_SINGLE_TURN`, equal to bfcl-eval's `SINGLE_TURN_CATEGORY`): simple_python, simple_java,
simple_javascript, multiple, parallel, parallel_multiple, irrelevance (non-live) and live_simple, live_multiple,
live_parallel, live_parallel_multiple, live_irrelevance, live_relevance: 3,641 items. Not covered (`NOT_COVERED`): BFCL
v3's multi-turn categories (multi_turn_base, _miss_func, _miss_param, _long_context: 800 items, data in the wheel) need
a conversation loop that executes each call against BFCL's simulated APIs between turns, which this one-request-per-item
runner does not drive; v3's executable categories (exec_simple, exec_multiple, exec_parallel, exec_parallel_multiple,
rest, sql, chatable) lie in the wheel's `data/unused_datasets` and bfcl-eval 2026.3.23 has no checker for them.

As BFCL does for an OpenAI-style function-calling model: each function's description gets the language hint and Java /
JavaScript parameters become strings (bfcl-eval's own `_func_doc_language_specific_pre_processing`), Gorilla types are
cast to JSON-schema types and dots in names become underscores (`to_tools`, BFCL's `convert_to_tool` for
OPENAI_COMPLETIONS, written out here because its module imports tree-sitter and tenacity; a test compares the two on
every item). A reply's calls are decoded as BFCL decodes them ([{name: json.loads(arguments)}]; no tool call leaves the
text, which does not decode), then: AST categories through `ast_checker` with the original function docs and the
category's language; irrelevance / live_irrelevance pass when no call decodes (or only empty ones), live_relevance when
one does.

Integrity (per call, recorded and summarized, never changing BFCL's verdict): arguments are a JSON object (well formed),
the name is one the answer expects (right function; for live_relevance one of the offered tools; for irrelevance none is
right), and the call alone matches that function's possible answer under BFCL's `simple_function_checker` (right
arguments); arguments breaking the tool's declared JSON schema are listed (a few of BFCL's own answers break theirs).
Item metrics `well_formed` (every call) and `right_function` (the called names are the expected ones) pair across runs;
`summarize` gives the call counts and the pass rate per category.

bfcl-eval's checker module imports every model handler through its model-config table, and its `utils` module makes
folders beside the installed package on import; both are loaded with those two constant modules replaced by stand-ins
(a table answering "underscore_to_dot" for any model, the data paths without the folders), so only BFCL's own checking
and data-preparation code runs.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.resources
import importlib.util
import json
import sys
import types
from collections import Counter, defaultdict
from importlib.metadata import version
from pathlib import Path

from ..errors import ConfigError
from ..registry import SUITES
from .runner import Item, Outcome, Suite

V3_SINGLE_TURN = ["simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple",
                  "irrelevance", "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
                  "live_irrelevance", "live_relevance"]
ALIASES = {"simple": "simple_python"}  # the name this suite used before it took BFCL's
NO_ANSWER = ("irrelevance", "live_irrelevance", "live_relevance")  # judged by whether a call decodes
NOT_COVERED = {
    "multi_turn_base": "multi-turn: needs the execution loop against BFCL's simulated APIs (data in the wheel)",
    "multi_turn_miss_func": "multi-turn: needs the execution loop against BFCL's simulated APIs (data in the wheel)",
    "multi_turn_miss_param": "multi-turn: needs the execution loop against BFCL's simulated APIs (data in the wheel)",
    "multi_turn_long_context": "multi-turn: needs the execution loop against BFCL's simulated APIs (data in the wheel)",
    **{c: "executable: data only in the wheel's data/unused_datasets, no checker in bfcl-eval 2026.3.23"
       for c in ("exec_simple", "exec_multiple", "exec_parallel", "exec_parallel_multiple", "rest", "sql", "chatable")},
}
MODEL_NAME = "fidelity"  # what BFCL's checkers get as the model name (the stand-in table maps any to underscore_to_dot)
_BFCL = None


def _stand_in_constants() -> dict[str, types.ModuleType]:
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or spec.origin is None:
        raise ConfigError("toolcall needs bfcl-eval's data and checker: pip install --no-deps bfcl-eval==2026.3.23 "
                          "(see .ci/install-test-deps)")
    data = Path(spec.origin).parent / "data"
    models = types.ModuleType("bfcl_eval.constants.model_config")
    models.MODEL_CONFIG_MAPPING = defaultdict(lambda: types.SimpleNamespace(underscore_to_dot=True))
    paths = types.ModuleType("bfcl_eval.constants.eval_config")
    paths.PROMPT_PATH, paths.POSSIBLE_ANSWER_PATH = data, data / "possible_answer"
    paths.MULTI_TURN_FUNC_DOC_PATH = data / "multi_turn_func_doc"
    return {m.__name__: m for m in (models, paths)}


def bfcl():
    """bfcl-eval's pieces this suite runs: a namespace with ast_checker, simple_function_checker, Language,
    GORILLA_TO_OPENAPI, is_function_calling_format_output, is_empty_output, language_hints (the docs preprocessing) and
    SINGLE_TURN_CATEGORY."""
    global _BFCL
    if _BFCL is None:
        stand_ins = _stand_in_constants()
        saved = {name: sys.modules.get(name) for name in stand_ins}
        sys.modules.update(stand_ins)
        try:
            from bfcl_eval.constants.category_mapping import SINGLE_TURN_CATEGORY
            from bfcl_eval.constants.enums import Language
            from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
            from bfcl_eval.eval_checker.ast_eval import ast_checker as checker
            from bfcl_eval import utils
        except ImportError as e:
            raise ConfigError(
                f"toolcall needs bfcl-eval's data and checker: pip install --no-deps bfcl-eval==2026.3.23 "
                f"(see .ci/install-test-deps): {e}"
            )
        finally:
            for name, mod in saved.items():
                if mod is not None:
                    sys.modules[name] = mod
                else:
                    sys.modules.pop(name, None)
        _BFCL = types.SimpleNamespace(
            ast_checker=checker.ast_checker, simple_function_checker=checker.simple_function_checker,
            find_description=checker.find_description, Language=Language, GORILLA_TO_OPENAPI=GORILLA_TO_OPENAPI,
            is_function_calling_format_output=utils.is_function_calling_format_output,
            is_empty_output=utils.is_empty_output, language_hints=utils._func_doc_language_specific_pre_processing,
            SINGLE_TURN_CATEGORY=list(SINGLE_TURN_CATEGORY))
    return _BFCL


def load_checker():
    """(ast_checker function, Language enum) from bfcl-eval."""
    b = bfcl()
    return b.ast_checker, b.Language


def language_of(category: str):
    lang = bfcl().Language
    return lang.JAVA if "java" in category and "javascript" not in category else \
        lang.JAVASCRIPT if "javascript" in category else lang.PYTHON


def _data_file(sub: str) -> tuple[str, bytes]:
    root = importlib.resources.files("bfcl_eval") / "data"
    f = root / sub
    if not f.is_file():
        raise ConfigError(f"toolcall: bfcl-eval has no data file {sub}")
    return str(f), f.read_bytes()


def _jsonl(raw: bytes, where: str) -> list[dict]:
    rows = []
    for lineno, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"toolcall: {where} line {lineno} is not JSON ({e})")
    return rows


def _cast_types(properties: dict, mapping: dict) -> dict:
    """BFCL's `_cast_to_openai_type` (model_handler/utils.py), in place."""
    for key, value in properties.items():
        if "type" not in value:
            value["type"] = "string"
        else:
            var_type = value["type"]
            if var_type == "float":
                value["format"] = "float"
                value["description"] += " This is a float type value."
            value["type"] = mapping.get(var_type, "string")
        if value["type"] in ("array", "object"):
            if "properties" in value:
                value["properties"] = _cast_types(value["properties"], mapping)
            elif "items" in value:
                value["items"]["type"] = mapping[value["items"]["type"]]
                if value["items"]["type"] == "array" and "items" in value["items"]:
                    value["items"]["items"]["type"] = mapping[value["items"]["items"]["type"]]
                elif value["items"]["type"] == "object" and "properties" in value["items"]:
                    value["items"]["properties"] = _cast_types(value["items"]["properties"], mapping)
    return properties


def to_tools(functions: list[dict]) -> list[dict]:
    """BFCL's `convert_to_tool(functions, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)`."""
    out = []
    for item in copy.deepcopy(functions):
        item["name"] = item["name"].replace(".", "_")
        item["parameters"]["type"] = "object"
        item["parameters"]["properties"] = _cast_types(item["parameters"]["properties"], bfcl().GORILLA_TO_OPENAPI)
        out.append({"type": "function", "function": item})
    return out


def bfcl_tools(functions: list[dict], category: str) -> list[dict]:
    """The tools BFCL sends for an item of `category`: language hints, then `to_tools`."""
    return to_tools(bfcl().language_hints(copy.deepcopy(functions), category))


def decode_calls(calls: list[dict]):
    """BFCL's function-calling decode of a reply: [{name: json.loads(arguments)}]; raises as BFCL's does on arguments
    that are not JSON. No calls: the reply's text, which does not decode (None here)."""
    if not calls:
        return None
    return [{c["name"]: json.loads(c["arguments"])} for c in calls]


def integrity(calls: list[dict], tools: list[dict]) -> tuple[list[dict], list[str]]:
    """The well-formed calls as BFCL's model output ([{name: args}]) and the integrity problems found (arguments not a
    JSON object, a name no tool has, arguments breaking the tool's JSON schema)."""
    import jsonschema  # noqa: PLC0415 (optional: the suites extra)

    by_name = {t["function"]["name"]: t["function"] for t in tools}
    parsed, problems = [], []
    for i, call in enumerate(calls):
        where = f"call {i} ({call['name']})"
        try:
            args = json.loads(call["arguments"])
        except json.JSONDecodeError as e:
            problems.append(f"{where}: arguments are not valid JSON ({e.msg})")
            continue
        if not isinstance(args, dict):
            problems.append(f"{where}: arguments are not a JSON object")
            continue
        parsed.append({call["name"]: args})
        fn = by_name.get(call["name"])
        if fn is None:
            problems.append(f"{where}: unknown function (offered: {', '.join(sorted(by_name))})")
            continue
        try:
            jsonschema.validate(args, fn["parameters"])
        except jsonschema.ValidationError as e:
            problems.append(f"{where}: arguments break the schema: {e.message[:160]}")
        except jsonschema.SchemaError:
            pass  # a tool schema jsonschema rejects is a data quirk, not the model's fault
    return parsed, problems


@SUITES.register("toolcall")
class ToolCall(Suite):
    name = "toolcall"
    metric = "passed"
    default_max_tokens = 512
    modes = ("chat",)
    group_by = "category"

    def __init__(self, categories=None, data: str | None = None):
        if data:
            raise ConfigError("toolcall: --data is not supported; the data come from the installed bfcl-eval package")
        categories = [ALIASES.get(c, c) for c in (categories or V3_SINGLE_TURN)]
        bad = [c for c in categories if c not in V3_SINGLE_TURN]
        if bad:
            why = "; ".join(f"{c}: {NOT_COVERED[c]}" for c in bad if c in NOT_COVERED)
            raise ConfigError(f"toolcall: categories {bad} are not covered" + (f" ({why})" if why else "") +
                              f"; covered: {V3_SINGLE_TURN}")
        self.categories = list(dict.fromkeys(categories))
        self._rows: dict[str, dict] = {}
        self._hashes: dict[str, str] = {}
        for cat in self.categories:
            self._read(cat)

    def _read(self, cat: str):
        sub = f"BFCL_v4_{cat}.json"
        path, raw = _data_file(sub)
        self._hashes[sub] = hashlib.sha256(raw).hexdigest()
        rows = _jsonl(raw, path)
        answers = {}
        if cat not in NO_ANSWER:
            apath, araw = _data_file(f"possible_answer/{sub}")
            self._hashes[f"possible_answer/{sub}"] = hashlib.sha256(araw).hexdigest()
            answers = {a["id"]: a["ground_truth"] for a in _jsonl(araw, apath)}
        for r in rows:
            rid = r.get("id")
            if not rid or not r.get("question") or "function" not in r:
                raise ConfigError(f"toolcall: {path}: row {rid!r} lacks id/question/function")
            if len(r["question"]) != 1:
                raise ConfigError(
                    f"toolcall: {path}: row {rid!r} is multi-turn; only single-turn categories are supported"
                )
            for f in r["function"]:
                if "name" not in f or "parameters" not in f:
                    raise ConfigError(f"toolcall: {path}: row {rid!r} has a function without name/parameters")
            if cat not in NO_ANSWER and rid not in answers:
                raise ConfigError(f"toolcall: {path}: row {rid!r} has no possible answer")
            if rid in self._rows:
                raise ConfigError(f"toolcall: {path}: duplicate id {rid!r}")
            self._rows[rid] = {**r, "category": cat, "answer": answers.get(rid)}

    def source(self) -> dict:
        return {"source": f"bfcl-eval {version('bfcl-eval')}", "sha256": self._hashes, "items": len(self._rows)}

    def config(self) -> dict:
        return {"categories": self.categories}

    def load(self) -> list[Item]:
        return [Item(rid, r["question"][0][-1]["content"], data={"category": r["category"]}, messages=r["question"][0],
                     tools=bfcl_tools(r["function"], r["category"])) for rid, r in self._rows.items()]

    def _expected(self, row: dict) -> list[tuple[str, dict]]:
        """(name as sent, possible-answer entry) per expected call."""
        return [(next(iter(a)).replace(".", "_"), a) for a in row["answer"] or []]

    def _call_checks(self, row: dict, parsed: list[dict], offered: set[str]) -> tuple[int, int]:
        """(calls to a right function, calls with right arguments) among the well-formed calls."""
        b, cat = bfcl(), row["category"]
        if cat in ("irrelevance", "live_irrelevance"):
            return 0, 0
        if cat == "live_relevance":
            right = sum(next(iter(c)) in offered for c in parsed)
            return right, right
        expected = self._expected(row)
        names, args_ok = 0, 0
        for call in parsed:
            name = next(iter(call))
            matches = [a for sent, a in expected if sent == name]
            names += bool(matches)
            for answer in matches:
                doc = b.find_description(row["function"], next(iter(answer)))
                if (
                    doc is not None
                    and b.simple_function_checker(doc, call, answer, language_of(cat), MODEL_NAME)["valid"]
                ):
                    args_ok += 1
                    break
        return names, args_ok

    def verdict(self, row: dict, calls: list[dict]) -> tuple[bool, str, dict]:
        """BFCL's decision on the reply's calls: (passed, verdict, checker's error type where it failed)."""
        b, cat = bfcl(), row["category"]
        try:
            decoded = decode_calls(calls)
            decode_error = None if decoded is not None else "no function call"
        except (json.JSONDecodeError, TypeError, AttributeError) as e:
            decoded, decode_error = None, f"arguments do not decode: {e}"
        if cat in NO_ANSWER:
            called = decoded is not None and not b.is_empty_output(decoded)
            if cat == "live_relevance":
                return (
                    called,
                    "called a function" if called else f"no call decodes ({decode_error or 'empty calls'})",
                    {} if called else {"error_type": "relevance_error:decoder_failed"},
                )
            return (
                not called,
                "no call, as none fits" if not called else f"called {len(decoded)} function(s) though none fits",
                {} if not called else {"error_type": "irrelevance_error:decoder_success"},
            )
        if decoded is None:
            return False, decode_error, {"error_type": "ast_decoder:decoder_failed"}
        if not b.is_function_calling_format_output(decoded):
            return False, "calls are not {name: {arguments}}", {"error_type": "ast_decoder:decoder_wrong_output_format"}
        res = b.ast_checker(row["function"], decoded, row["answer"], language_of(cat), cat, MODEL_NAME)
        if res.get("valid"):
            return True, "matches a possible answer", {}
        return False, "; ".join(map(str, res.get("error", [])))[:500], {k: res[k] for k in ("error_type",) if k in res}

    def score(self, item: Item, text: str, tool_calls: list) -> Outcome:
        row = self._rows[item.item_id]
        parsed, problems = integrity(tool_calls, item.tools)
        offered = {t["function"]["name"] for t in item.tools}
        well_formed = sum(1 for p in problems if "arguments are not" in p)
        well_formed = len(tool_calls) - well_formed
        right_fn, right_args = self._call_checks(row, parsed, offered)
        ok, verdict, checker = self.verdict(row, tool_calls)
        if problems:  # recorded, not deciding: BFCL's checker decides (a few of its own answers break their schema)
            verdict += " (integrity: " + "; ".join(problems) + ")"
        cat = row["category"]
        called = Counter(next(iter(c)) for c in parsed)
        if cat in ("irrelevance", "live_irrelevance"):
            names_right = not tool_calls
        elif cat == "live_relevance":
            names_right = bool(tool_calls) and all(c["name"] in offered for c in tool_calls)
        else:
            names_right = len(parsed) == len(tool_calls) and called == Counter(n for n, _ in self._expected(row))
        details = {"category": cat, "calls": len(tool_calls), "well_formed_calls": well_formed,
                   "right_function_calls": right_fn, "right_argument_calls": right_args, "integrity": problems}
        if checker:
            details["checker"] = checker
        return Outcome(json.dumps(parsed), ok, verdict=verdict, details=details,
                       metrics={"well_formed": well_formed == len(tool_calls), "right_function": names_right})

    def summarize(self, records: list) -> dict:
        """Call-level integrity over the run (calls, well formed, right function, right arguments) and pass rate per
        BFCL category."""
        calls = {"calls": 0, "well_formed": 0, "right_function": 0, "right_arguments": 0}
        cats: dict[str, dict] = {c: {"items": 0, "passed": 0, "errors": 0} for c in self.categories}
        for r in records:
            cat = self._rows[r.item_id]["category"] if r.item_id in self._rows else "?"
            c = cats.setdefault(cat, {"items": 0, "passed": 0, "errors": 0})
            if r.error:
                c["errors"] += 1
                continue
            det = json.loads(r.details or "{}")
            c["items"] += 1
            c["passed"] += bool(r.passed)
            for key, field in (("calls", "calls"), ("well_formed", "well_formed_calls"),
                               ("right_function", "right_function_calls"), ("right_arguments", "right_argument_calls")):
                calls[key] += int(det.get(field) or 0)
        for c in cats.values():
            c["pass_rate"] = c["passed"] / c["items"] if c["items"] else None
        return {"calls": calls, "categories": {k: v for k, v in cats.items() if v["items"] or v["errors"]},
                "not_covered": NOT_COVERED}
