"""fidelity.registry: entries registered by decorator in their own modules, found by importing the package on first
lookup (so one new file adds one), and a name registered twice by different objects is an error naming both."""
from __future__ import annotations

import sys
import textwrap

import pytest

from fidelity.registry import ARCHITECTURES, Registry


def test_architectures_are_the_families_that_compute_them():
    # written out here, not read from the code: the table before the registry replaced it
    expected = {
        "LlamaForCausalLM": "llama.LlamaFamily", "MistralForCausalLM": "llama.LlamaFamily",
        "Qwen2ForCausalLM": "llama.LlamaFamily", "Qwen3ForCausalLM": "llama.LlamaFamily",
        "Qwen3MoeForCausalLM": "moe.MoeFamily", "MixtralForCausalLM": "moe.MoeFamily",
        "DeepseekV3ForCausalLM": "deepseek.v3.DeepseekV3Family",
        "DeepseekV32ForCausalLM": "deepseek.v32.DeepseekV32Family",
        "DeepseekV4ForCausalLM": "deepseek.v4.DeepseekV4Family",
        "DeepseekV41ForCausalLM": "deepseek.v41.DeepseekV41Family",
    }
    got = {name: f"{cls.__module__.removeprefix('fidelity.oracle.')}.{cls.__qualname__}"
           for name, cls in ARCHITECTURES.items()}
    assert got == expected


def test_a_new_module_registers_itself_and_duplicates_are_refused(tmp_path, monkeypatch):
    pkg = tmp_path / "regpkg_under_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from fidelity.registry import Registry\nTHINGS = Registry('thing', __name__)\n")
    (pkg / "one.py").write_text(textwrap.dedent("""
        from . import THINGS

        @THINGS.register("a", "b")
        class One: ...
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import regpkg_under_test

        things: Registry = regpkg_under_test.THINGS
        assert "regpkg_under_test.one" not in sys.modules  # nothing imported before the first lookup
        assert sorted(things) == ["a", "b"] and things["a"] is things["b"]
        assert things.get("c") is None

        (pkg / "two.py").write_text("from . import THINGS\n\n@THINGS.register('a')\nclass Two: ...\n")
        with pytest.raises(ValueError, match=r"thing 'a' is registered twice: regpkg_under_test\.one\.One and "
                                             r"regpkg_under_test\.two\.Two"):
            __import__("regpkg_under_test.two")
    finally:
        for name in [m for m in sys.modules if m.startswith("regpkg_under_test")]:
            del sys.modules[name]


def test_gates_are_the_kinds_that_run_them_in_the_gate_commands_order():
    from fidelity.engine.gates.config import configured_gates, select_gates
    from fidelity.registry import GATES

    # written out here: the gate command's table before the registry replaced it, in the order `fidelity gate` runs them
    expected = [
        ("oracle-kl", "fidelity.engine.gates.oracle_kl"),
        ("batch-invariance", "fidelity.engine.gates.invariance"),
        ("decode-vs-prefill", "fidelity.engine.gates.invariance"),
        ("prefix-cache", "fidelity.engine.gates.invariance"),
        ("speed", "fidelity.engine.bench"),
        ("suite", "fidelity.suites.gate"),
    ]
    assert [(name, kind.run.__module__) for name, kind in GATES.items()] == expected
    assert select_gates(None) == ["oracle-kl", "batch-invariance", "decode-vs-prefill", "prefix-cache"]
    cfg = {"suite": {"humaneval": {"baseline": "a"}, "mmlu": {"baseline": "b"}}, "speed": {"baseline": "c"}}
    assert configured_gates(cfg) == ["speed", "suite.humaneval", "suite.mmlu"]
    assert select_gates("suite.mmlu,prefix-cache", cfg) == ["suite.mmlu", "prefix-cache"]


def test_a_registry_of_named_modules_keeps_registration_order(tmp_path, monkeypatch):
    (tmp_path / "regorder_a.py").write_text(
        "from fidelity.registry import Registry\n"
        "THINGS = Registry('thing', modules=('regorder_a', 'regorder_b', 'regorder_c'))\n"
        "@THINGS.register('zeta')\ndef zeta(): ...\n"
    )
    (tmp_path / "regorder_b.py").write_text(
        "from regorder_a import THINGS\n@THINGS.register('alpha')\ndef alpha(): ...\n"
    )
    (tmp_path / "regorder_c.py").write_text(
        "from regorder_a import THINGS\n@THINGS.register('gamma')\ndef gamma(): ...\n"
        "@THINGS.register('beta')\ndef beta(): ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import regorder_c  # imported before regorder_b: the module list still decides the order

        assert "regorder_b" not in sys.modules
        assert list(regorder_c.THINGS) == ["zeta", "alpha", "gamma", "beta"]
        with pytest.raises(ValueError, match="not both or neither"):
            Registry("thing")
    finally:
        for name in ("regorder_a", "regorder_b", "regorder_c"):
            sys.modules.pop(name, None)


def test_format_claimers_claim_in_the_former_order_native_last():
    from fidelity.registry import CLAIMERS

    # written out here: the order register_claimer's side effects built (exl3 inserted first, native appended last)
    expected = [("exl3", "fidelity.packs.exl3.layouts"), ("compressed-tensors", "fidelity.packs.compressed"),
                ("fp4", "fidelity.packs.fp4"), ("fp8", "fidelity.packs.fp8"), ("native", "fidelity.packs.native")]
    assert [(name, fn.__module__) for name, fn in CLAIMERS.items()] == expected


def test_suites_are_the_factories_the_if_chain_called_and_listing_them_imports_none():
    import os
    import subprocess
    from pathlib import Path

    # written out here: make_suite's if-chain before the registry replaced it
    expected = {
        "humaneval": "humaneval.humaneval",
        "humaneval+": "humaneval.humaneval_plus",
        "mbpp+": "humaneval.mbpp_plus",
        "ifeval": "ifeval.IFEval",
        "mmlu": "mmlu.MMLU",
        "gsm8k": "gsm8k.GSM8K",
        "needle": "needle.Needle",
        "toolcall": "toolcall.ToolCall",
    }
    code = ("import sys; from fidelity.registry import SUITES; names = list(SUITES); "
            "print(','.join(names), any(m in sys.modules for m in SUITES.declared_names().values()))")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [",".join(sorted(expected)), "False"]

    from fidelity.registry import SUITES
    from fidelity.suites import make_suite

    got = {name: f"{f.__module__.removeprefix('fidelity.suites.')}.{f.__qualname__}" for name, f in SUITES.items()}
    assert got == expected
    suite = make_suite("gsm8k", shots=3)
    assert (type(suite).__name__, suite.name, suite.shots) == ("GSM8K", "gsm8k", 3)


def test_a_declared_registry_reads_names_without_importing(tmp_path, monkeypatch):
    pkg = tmp_path / "declpkg_under_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from fidelity.registry import Registry\n"
                                     "KINDS = Registry('kind', __name__, declared='KINDS')\n")
    (pkg / "one.py").write_text("from . import KINDS\n\n@KINDS.register('a', 'b')\nclass One: ...\n")
    (pkg / "two.py").write_text("from . import KINDS\n\n@KINDS.register('c')\ndef two(): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import declpkg_under_test

        kinds: Registry = declpkg_under_test.KINDS
        assert list(kinds) == ["a", "b", "c"] and len(kinds) == 3 and "b" in kinds and "z" not in kinds
        assert not any(m.startswith("declpkg_under_test.") for m in sys.modules)
        assert kinds["c"].__name__ == "two"
        assert "declpkg_under_test.two" in sys.modules and "declpkg_under_test.one" not in sys.modules
        assert kinds.get("z") is None

        (pkg / "three.py").write_text("from . import KINDS\nNAME = 'd'\n\n@KINDS.register(NAME)\ndef three(): ...\n")
        kinds._declared = None
        with pytest.raises(ValueError, match=r"three\.py:4: KINDS\.register takes string literals only"):
            list(kinds)
        (pkg / "three.py").write_text("from . import KINDS\n\n@KINDS.register('a')\ndef three(): ...\n")
        with pytest.raises(ValueError, match=r"kind 'a' is declared twice: in declpkg_under_test\.one and "
                                             r"declpkg_under_test\.three"):
            list(kinds)
        (pkg / "three.py").write_text("from . import KINDS\n\n@KINDS.register('d')\ndef three(): ...\n"
                                      "KINDS._entries.pop('d')\n")
        with pytest.raises(LookupError, match=r"declpkg_under_test\.three declares kind 'd' but registered nothing"):
            kinds["d"]
    finally:
        for name in [m for m in sys.modules if m.startswith("declpkg_under_test")]:
            del sys.modules[name]
