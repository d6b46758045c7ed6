"""The tree passes the lint settings in pyproject.toml ([tool.ruff]): line length, pyflakes, and imports inside
functions only for the heavy optional dependencies (TID253 keeps them off module level) or with a stated reason."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff() -> list[str]:
    try:
        import ruff  # noqa: F401  (the test extra pins it)
    except ImportError:
        if shutil.which("ruff") is None:
            pytest.skip("missing tool: ruff (pip install -e '.[test]')")
        return ["ruff"]
    return [sys.executable, "-m", "ruff"]


def test_ruff_check_passes_on_the_whole_tree():
    out = subprocess.run([*ruff(), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_ruff_finds_what_it_is_configured_to_find(tmp_path):
    # the configuration is live: a long line, an unused import and a function-level import of a core module are caught
    bad = tmp_path / "fidelity" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("import os\n\n\ndef f():\n    import json\n    return json.dumps('" + "x" * 120 + "')\n")
    out = subprocess.run([*ruff(), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    for code in ("F401", "PLC0415", "E501"):
        assert code in out.stdout, out.stdout
