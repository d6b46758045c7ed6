"""The command line starts without torch: `fidelity --help` and every subcommand's argument parser import no heavy
module (torch alone costs seconds), while `from fidelity import open_pack` keeps working for library users."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_cli_import_and_every_parser_leave_torch_unimported():
    code = """
import sys
import fidelity.cli
after_import = 'torch' in sys.modules
parser = fidelity.cli.build_parser()
commands = sorted(parser._subparsers._group_actions[0].choices)
for name in commands:
    try:
        parser.parse_args([name, '--help'])
    except SystemExit:
        pass
from fidelity.registry import SUITES
suites = any(m in sys.modules for m in SUITES.declared_names().values())  # `suite run` lists them unimported
print(after_import, 'torch' in sys.modules, 'transformers' in sys.modules, suites, ','.join(commands))
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    after_import, after_parsers, transformers, suites, commands = out.stdout.split()[-5:]
    assert (after_import, after_parsers, transformers, suites) == ("False", "False", "False", "False"), out.stdout
    assert {"compare", "gate", "inspect", "panel", "reference", "serve"} <= set(commands.split(","))


def test_open_pack_still_imports_from_the_package():
    out = run_python(
        "import sys, fidelity; from fidelity import open_pack; import fidelity.packs as p; "
        "print(open_pack is p.open_pack is fidelity.open_pack, fidelity.packs is p, 'torch' in sys.modules)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True"]
    out = run_python("import fidelity; fidelity.no_such_name")
    assert out.returncode != 0 and "has no attribute 'no_such_name'" in out.stderr
