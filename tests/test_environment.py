"""fidelity/environment.py reads the FIDELITY_* variables once, for the command line: each variable's value, the
defaults of an empty environment (the library's own defaults, exactly), a value it cannot read named with its variable,
no other module of the package reading a FIDELITY_* variable, and the packs the command line opens hashing into
FIDELITY_CACHE and decoding EXL3 with FIDELITY_EXL3_SUMS (PackSettings, passed in)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from blake3 import blake3

import _golden
import fidelity.content_hash as content_hash
from fidelity.environment import EXL3_SUMS, METRICS_KERNELS, Environment
from fidelity.errors import ConfigError
from fidelity.measuring.metrics import MetricKernel
from fidelity.oracle.parallel import RunSettings
from fidelity.pack_settings import PackSettings
from fidelity.packs.exl3 import layouts

ROOT = Path(__file__).resolve().parent.parent


def test_an_empty_environment_gives_the_librarys_defaults():
    env = Environment.from_environ({})
    assert env == Environment()
    assert RunSettings(**env.run_settings()) == RunSettings()
    assert MetricKernel(backend=env.metrics_kernel) == MetricKernel()
    assert env.cache_dir() == Path.home() / ".cache" / "fidelity"
    assert env.pack_settings() == PackSettings(hash_cache=content_hash.default_cache_dir())


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
    assert reads == {}


@pytest.fixture
def exl3_pack(tmp_path_factory):
    return _golden.exl3_checkpoint("exl3_4p0_mul1", tmp_path_factory.mktemp("exl3"))


@pytest.mark.parametrize("set_cache", [True, False], ids=["FIDELITY_CACHE", "unset"])
def test_the_command_line_caches_pack_digests_in_fidelity_cache(exl3_pack, tmp_path, monkeypatch, set_cache):
    """`fidelity inspect` fingerprints the pack: each file's digest lands in $FIDELITY_CACHE/content-hash, and only
    there; unset, in ~/.cache/fidelity/content-hash (HOME moved to the test's folder)."""
    from fidelity import cli
    monkeypatch.setattr(content_hash, "RACY_NS", 0)    # the files were just written: cache them anyway
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FIDELITY_CACHE", raising=False)
    if set_cache:
        monkeypatch.setenv("FIDELITY_CACHE", str(tmp_path / "cache"))
    want = (tmp_path / "cache" if set_cache else tmp_path / "home" / ".cache" / "fidelity") / "content-hash"
    assert cli.main(["inspect", str(exl3_pack), "--json", str(tmp_path / "inspect.json")]) == 0
    shards = sorted(exl3_pack.glob("*.safetensors"))
    entries = [json.loads(p.read_text()) for p in want.glob("*.json")]
    assert shards and {e["path"]: e["digest"] for e in entries} == {
        str(p.resolve()): blake3(p.read_bytes()).hexdigest() for p in shards}
    elsewhere = [p for p in tmp_path.rglob("*.json") if p.parent != want and p.name != "inspect.json"]
    assert elsewhere == []


@pytest.mark.parametrize("sums", ["int64", "float64", None])
def test_the_command_line_decodes_exl3_with_fidelity_exl3_sums(exl3_pack, monkeypatch, sums):
    """`fidelity inspect --decode` decodes every EXL3 linear with the sums FIDELITY_EXL3_SUMS names (unset: the
    device's default, `sums=None`), and the weights are the default decode's, bit for bit."""
    from fidelity import cli, open_pack
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("sums"))
        return decode_weight(*args, **kwargs)

    decode_weight = layouts.decode_weight
    monkeypatch.setattr(layouts, "decode_weight", spy)
    monkeypatch.delenv("FIDELITY_EXL3_SUMS", raising=False)
    if sums:
        monkeypatch.setenv("FIDELITY_EXL3_SUMS", sums)
    assert cli.main(["inspect", str(exl3_pack), "--decode"]) == 0
    assert len(seen) == 15 and set(seen) == {sums}
    forced, default = open_pack(exl3_pack, PackSettings(exl3_sums=sums or "int64")), open_pack(exl3_pack)
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(forced.tensor(name), default.tensor(name))
