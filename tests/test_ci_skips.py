"""Under FIDELITY_CI a skip for missing data, a missing tool or root fails (tests/_ci_skips.py), at run time and at
collection; a GPU skip, an xfail and a "full data only:" skip stay as they are; and every skip reason written in tests/
says which kind it is, so that the classification holds for the tests there are."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import _ci_skips

TESTS = Path(__file__).resolve().parent
# skips for what a CPU-only CI machine is not: a GPU, another CPU, another kernel (these stay skips in CI)
PLATFORM = re.compile(r"CUDA|GPU|two threads|AVX2|/proc|x86-64|user namespaces|cgroups|VmHWM")

CASES = '''
import pytest
@pytest.fixture
def data():
    pytest.skip("missing data: golden.bin")
def test_data(data): pass
def test_tool(): pytest.importorskip("no_such_module_fidelity_ci")
def test_root(): pytest.skip("needs root: to become uid 65534")
@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_gpu(): pass
def test_full(): pytest.skip("full data only: the 3inst checkpoint")
@pytest.mark.xfail(reason="missing data: an expected failure is no skip")
def test_xfail(): assert False
def test_runs(): pass
'''


def _pytest(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_module_skip.py").write_text('import pytest\npytest.importorskip("no_such_module_fidelity_ci")\n')
    env = {k: v for k, v in os.environ.items() if k != _ci_skips.CI_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if ci:
        env[_ci_skips.CI_ENV] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "_ci_skips",
                           "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)


def _outcomes(out: str) -> dict[str, str]:
    found = {}
    for line in out.splitlines():
        m = re.match(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL)( \[\d+\])? (\S+)", line)
        if m:
            found[m.group(3).split("::")[-1].removesuffix(":")] = m.group(1)
    return found


def test_ci_fails_skips_for_missing_data_tools_and_root(tmp_path):
    run = _pytest(tmp_path, ci=True)
    got = _outcomes(run.stdout)
    assert run.returncode == 1, run.stdout[-3000:]
    assert got["test_data"] == "ERROR" and got["test_tool"] == "FAILED" and got["test_root"] == "FAILED", got
    assert "FAILED (skipped at collection) test_module_skip.py: FIDELITY_CI is set" in run.stdout, run.stdout[-3000:]
    assert got["test_runs"] == "PASSED" and got["test_xfail"] == "XFAIL", got
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert (
        len(skipped) == 3
        and any("test_module_skip.py" in s for s in skipped)
        and any("needs a CUDA device" in s for s in skipped)
        and any("full data only:" in s for s in skipped)
    ), skipped
    assert "FIDELITY_CI is set" in run.stdout and "missing data: golden.bin" in run.stdout


def test_outside_ci_they_stay_skips(tmp_path):
    run = _pytest(tmp_path, ci=False)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "6 skipped" in run.stdout.splitlines()[-1] and "1 passed" in run.stdout.splitlines()[-1], run.stdout[-500:]


def _reason_text(node: ast.expr | None) -> str | None:
    """A reason's literal text ({} for its formatted parts); None where it is not written out."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _skip_reasons(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr == "skip" and node.args:
            text = _reason_text(node.args[0])
        elif node.func.attr == "skipif":
            text = next((_reason_text(k.value) for k in node.keywords if k.arg == "reason"), "")
        else:
            continue
        out.append((node.lineno, text if text is not None else "<not a literal>"))
    return out


def test_every_skip_reason_in_tests_says_its_kind():
    """A reason starts with "missing data:", "missing tool:", "needs root:" (CI fails them) or "full data only:", or
    names the hardware or platform it needs (a GPU, two threads, AVX2, /proc, x86-64, user namespaces, cgroups)."""
    unclassified = []
    for path in sorted(TESTS.glob("*.py")):
        for line, reason in _skip_reasons(path):
            if not (_ci_skips.is_gap(reason) or reason.startswith(_ci_skips.STAYS) or PLATFORM.search(reason)):
                unclassified.append(f"{path.name}:{line}: {reason!r}")
    assert not unclassified, "skip reasons of no known kind:\n" + "\n".join(unclassified)
    assert _ci_skips.is_gap("could not import 'llama_cpp': No module named 'llama_cpp'")   # pytest.importorskip's
    assert not _ci_skips.is_gap("needs a CUDA device") and not _ci_skips.is_gap("full data only: x")
