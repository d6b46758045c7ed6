"""fidelity/environment.py reads the FIDELITY_* variables once, for the command line: each variable's value, the
defaults of an empty environment (the library's own defaults, exactly), a value it cannot read named with its variable,
and no other module of the package reading a FIDELITY_* variable (but the two not yet passed in, listed)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fidelity.environment import EXL3_SUMS, METRICS_KERNELS, Environment
from fidelity.errors import ConfigError
from fidelity.measuring.metrics import MetricKernel
from fidelity.oracle.parallel import RunSettings

ROOT = Path(__file__).resolve().parent.parent
# library modules that still read their variable where it is used (not yet passed in from the command line):
# the content-hash cache folder (Pack.fingerprint has no settings), the EXL3 Hadamard sums (decoded inside a pack)
STILL_READ_IN_PLACE = {"fidelity/content_hash.py": {"FIDELITY_CACHE"}, "fidelity/packs/exl3/codec.py": {"SUMS_ENV"}}


def test_an_empty_environment_gives_the_librarys_defaults():
    env = Environment.from_environ({})
    assert env == Environment()
    assert RunSettings(**env.run_settings()) == RunSettings()
    assert MetricKernel(backend=env.metrics_kernel) == MetricKernel()
    assert env.cache_dir() == Path.home() / ".cache" / "fidelity"


def test_every_variable_is_read(tmp_path):
    env = Environment.from_environ({
        "FIDELITY_CACHE": str(tmp_path), "FIDELITY_METRICS_KERNEL": "torch", "FIDELITY_EXL3_SUMS": "int64",
        "FIDELITY_DEVICE_ACTIVATIONS_GIB": "1.5", "FIDELITY_PREFETCH": "0", "FIDELITY_SHARD_LOADS": "0",
        "FIDELITY_STAGE_BUDGET_BYTES": "4096", "FIDELITY_DIST_STALE_S": "3", "FIDELITY_DIST_TIMEOUT_S": "60",
        "FIDELITY_SMOLLM2_GGUF": str(tmp_path / "s.gguf"), "FIDELITY_BWRAP": "/opt/bwrap"})
    assert env == Environment(cache=tmp_path, metrics_kernel="torch", exl3_sums="int64",
                              device_activations_bytes=3 * 2**29, prefetch=False, shard_loads=False,
                              stage_budget_bytes=4096.0, dist_stale_s=3.0, dist_timeout_s=60.0,
                              smollm2_gguf=tmp_path / "s.gguf", bwrap="/opt/bwrap")
    assert RunSettings(parallel="experts", **env.run_settings()) == RunSettings(
        parallel="experts", prefetch=False, shard_loads=False, stage_budget_bytes=4096.0, stale_s=3.0, timeout_s=60.0,
        activation_budget_bytes=3 * 2**29)
    # as the library read them: empty is unset, anything but "0" keeps prefetching on
    assert Environment.from_environ({"FIDELITY_DIST_STALE_S": "", "FIDELITY_PREFETCH": "no",
                                     "FIDELITY_SMOLLM2_GGUF": "", "FIDELITY_BWRAP": ""}) == Environment()


@pytest.mark.parametrize("name, value, expected", [
    ("FIDELITY_METRICS_KERNEL", "tpu", "one of 'torch', 'triton'"),
    ("FIDELITY_EXL3_SUMS", "fast", "one of 'float64', 'int64', 'int8'"),
    ("FIDELITY_DEVICE_ACTIVATIONS_GIB", "lots", "a number of GiB"),
    ("FIDELITY_STAGE_BUDGET_BYTES", "1e", "a number"),
    ("FIDELITY_DIST_STALE_S", "two minutes", "a number"),
    ("FIDELITY_DIST_TIMEOUT_S", "x", "a number")])
def test_a_value_it_cannot_read_is_named(name, value, expected):
    with pytest.raises(ConfigError, match=f"^{name}={value!r}: expected {expected}"):
        Environment.from_environ({name: value})


def test_the_accepted_values_are_the_librarys():
    from fidelity.packs.exl3 import codec
    assert set(METRICS_KERNELS) == set(MetricKernel.CHOICES["backend"]) - {None}
    assert EXL3_SUMS == codec.HADAMARD_SUMS


def test_the_command_line_hands_the_environment_to_the_command(monkeypatch):
    from fidelity import cli
    from fidelity.commands import inspect
    seen = []
    monkeypatch.setattr(inspect, "run", lambda args: seen.append(args.environment) or 0)
    monkeypatch.setenv("FIDELITY_PREFETCH", "0")
    assert cli.main(["inspect", "x"]) == 0 and seen == [Environment(prefetch=False)]
    monkeypatch.setenv("FIDELITY_METRICS_KERNEL", "tpu")
    assert cli.main(["inspect", "x"]) == 2                       # a ConfigError: "could not run", named


def _reads(tree: ast.AST) -> set[str]:
    """Names of the variables a module reads: os.environ[...] / .get(...) / os.getenv(...) with a literal or a name."""
    found = set()
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            target = node.slice
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv", "environ.get"):
            target = node.args[0] if node.args else None
        if target is not None:
            found.add(target.value if isinstance(target, ast.Constant) else ast.unparse(target))
    return found


def test_no_library_module_reads_a_fidelity_variable():
    reads = {}
    for path in sorted((ROOT / "fidelity").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        names = {n for n in _reads(ast.parse(path.read_text())) if "FIDELITY" in n or n.endswith("_ENV")}
        if names and rel != "fidelity/environment.py":
            reads[rel] = names
    assert reads == STILL_READ_IN_PLACE
