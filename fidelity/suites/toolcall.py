"""Tool calling: BFCL's single-turn Python categories (simple, multiple, parallel, parallel_multiple, irrelevance) from PyPI
`bfcl-eval`, sent as OpenAI `tools`, judged by BFCL's own AST checker, after our integrity checks.

Integrity checks (each failure names the call): arguments are valid JSON objects; the function name is one of the offered
tools; for `irrelevance` items, where no offered tool fits, there is no call at all; these fail the item. Arguments are also
validated against the tool's JSON schema (types, required fields, enums); a violation is recorded in `details.integrity` and the
verdict but does not by itself fail the item, because a few of BFCL's own possible answers break their declared schema (e.g.
simple_python_96 passes a list where the schema says string; 5 of the 1,000 answerable items). Then BFCL's `ast_checker`
compares the calls with the possible answers and decides.

Function names with dots are sent with underscores (OpenAI's name pattern), as BFCL does for function-calling models; its
checker maps the expected names the same way. BFCL's checker module imports every model handler through its model-config
table (and so the SDKs of a dozen vendors); we load it with that one table replaced by a stand-in that answers
"underscore_to_dot" for any model, so only the checker's own code runs.
"""
from __future__ import annotations

import hashlib
import importlib.resources
import json
import sys
import types
from collections import defaultdict

from ..errors import ConfigError
from ..registry import SUITES
from .runner import Item, Outcome, Suite

CATEGORIES = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel",
              "parallel_multiple": "parallel_multiple", "irrelevance": "irrelevance"}
_CHECKER = None


def load_checker():
    """(ast_checker function, Language enum) from bfcl-eval."""
    global _CHECKER
    if _CHECKER is None:
        name = "bfcl_eval.constants.model_config"
        stub = types.ModuleType(name)
        stub.MODEL_CONFIG_MAPPING = defaultdict(lambda: types.SimpleNamespace(underscore_to_dot=True))
        real = sys.modules.get(name)
        sys.modules[name] = stub
        try:
            from bfcl_eval.constants.enums import Language
            from bfcl_eval.eval_checker.ast_eval import ast_checker as module
        except ImportError as e:
            raise ConfigError(f"toolcall needs bfcl-eval's data and checker: pip install --no-deps bfcl-eval==2026.3.23 "
                              f"(see .ci/install-test-deps): {e}")
        finally:
            if real is not None:
                sys.modules[name] = real
            else:
                sys.modules.pop(name, None)
        _CHECKER = (module.ast_checker, Language)
    return _CHECKER


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


def to_openai_schema(schema: dict) -> dict:
    """BFCL's Gorilla parameter types (dict, float, tuple, any) as JSON-schema types."""
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI

    out = {}
    for k, v in schema.items():
        if k == "type":
            out[k] = GORILLA_TO_OPENAPI.get(v, v)
        elif k == "properties":
            out[k] = {name: to_openai_schema(p) for name, p in v.items()}
        elif k in ("items", "additionalProperties") and isinstance(v, dict):
            out[k] = to_openai_schema(v)
        else:
            out[k] = v
    return out


def to_tools(functions: list[dict]) -> list[dict]:
    return [{"type": "function", "function": {"name": f["name"].replace(".", "_"), "description": f.get("description", ""),
                                              "parameters": to_openai_schema(f["parameters"])}} for f in functions]


def integrity(calls: list[dict], tools: list[dict]) -> tuple[list[dict], list[str]]:
    """Parsed calls as BFCL's model output ([{name: args}]) and the integrity problems found."""
    import jsonschema

    by_name = {t["function"]["name"]: t["function"] for t in tools}
    parsed, problems = [], []
    for i, call in enumerate(calls):
        where = f"call {i} ({call['name']})"
        try:
            args = json.loads(call["arguments"]) if call["arguments"].strip() else {}
        except json.JSONDecodeError as e:
            problems.append(f"{where}: arguments are not valid JSON ({e.msg})")
            continue
        if not isinstance(args, dict):
            problems.append(f"{where}: arguments are not a JSON object")
            continue
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
        parsed.append({call["name"]: args})
    return parsed, problems


@SUITES.register("toolcall")
class ToolCall(Suite):
    name = "toolcall"
    metric = "passed"
    default_max_tokens = 512
    modes = ("chat",)

    def __init__(self, categories=None, data: str | None = None):
        if data:
            raise ConfigError("toolcall: --data is not supported; the data come from the installed bfcl-eval package")
        categories = list(categories or CATEGORIES)
        bad = [c for c in categories if c not in CATEGORIES]
        if bad:
            raise ConfigError(f"toolcall: unknown categories {bad}; known: {list(CATEGORIES)}")
        self.categories = categories
        self._rows: dict[str, dict] = {}
        self._hashes: dict[str, str] = {}
        for cat in categories:
            self._read(cat)

    def _read(self, cat: str):
        sub = f"BFCL_v4_{CATEGORIES[cat]}.json"
        path, raw = _data_file(sub)
        self._hashes[sub] = hashlib.sha256(raw).hexdigest()
        rows = _jsonl(raw, path)
        answers = {}
        if cat != "irrelevance":
            apath, araw = _data_file(f"possible_answer/{sub}")
            self._hashes[f"possible_answer/{sub}"] = hashlib.sha256(araw).hexdigest()
            answers = {a["id"]: a["ground_truth"] for a in _jsonl(araw, apath)}
        for r in rows:
            rid = r.get("id")
            if not rid or not r.get("question") or not r.get("function"):
                raise ConfigError(f"toolcall: {path}: row {rid!r} lacks id/question/function")
            if len(r["question"]) != 1:
                raise ConfigError(f"toolcall: {path}: row {rid!r} is multi-turn; only single-turn categories are supported")
            for f in r["function"]:
                if "name" not in f or "parameters" not in f:
                    raise ConfigError(f"toolcall: {path}: row {rid!r} has a function without name/parameters")
            if cat != "irrelevance" and rid not in answers:
                raise ConfigError(f"toolcall: {path}: row {rid!r} has no possible answer")
            if rid in self._rows:
                raise ConfigError(f"toolcall: {path}: duplicate id {rid!r}")
            self._rows[rid] = {**r, "category": cat, "answer": answers.get(rid)}

    def source(self) -> dict:
        from importlib.metadata import version

        return {"source": f"bfcl-eval {version('bfcl-eval')}", "sha256": self._hashes, "items": len(self._rows)}

    def config(self) -> dict:
        return {"categories": self.categories}

    def load(self) -> list[Item]:
        return [Item(rid, r["question"][0][-1]["content"], data={"category": r["category"]}, messages=r["question"][0],
                     tools=to_tools(r["function"])) for rid, r in self._rows.items()]

    def score(self, item: Item, text: str, tool_calls: list) -> Outcome:
        row = self._rows[item.item_id]
        parsed, problems = integrity(tool_calls, item.tools)
        extracted = json.dumps(parsed)
        details = {"category": row["category"], "calls": len(tool_calls), "integrity": problems}
        if row["category"] == "irrelevance":
            ok = not tool_calls
            return Outcome(extracted, ok, verdict="no call, as none fits" if ok else f"called {len(tool_calls)} function(s) "
                           f"though none fits", details=details)
        fatal = [p for p in problems if "arguments break the schema: " not in p]
        if fatal:
            return Outcome(extracted, False, verdict="; ".join(fatal), details=details)
        if not parsed:
            return Outcome(extracted, False, verdict="no function call", details=details)
        checker, language = load_checker()
        res = checker(row["function"], parsed, row["answer"], language.PYTHON, row["category"], "fidelity")
        ok = bool(res.get("valid"))
        if not ok:
            details["checker"] = {k: res[k] for k in ("error_type",) if k in res}
        verdict = "matches a possible answer" if ok else "; ".join(map(str, res.get("error", [])))[:500]
        if problems:  # recorded, not fatal: a few of BFCL's own possible answers break their declared schema
            verdict += " (schema: " + "; ".join(problems) + ")"
        return Outcome(extracted, ok, verdict=verdict, details=details)
