"""Registries filled by decorators in the modules that define their entries, so adding one is one new file:

    @ARCHITECTURES.register("LlamaForCausalLM", "MistralForCausalLM")
    class LlamaFamily(Family): ...

A `Registry` is a read-only mapping name -> entry. On first lookup it imports every module of its package and of
its subpackages, so a new module is found without an import list; the entries' modules stay unimported until something
asks. Where order matters (gates run in a fixed order, format claimers claim in one), the registry names its modules
instead: entries iterate in the order of their modules in that list (within a module, as registered), whatever order the
modules were imported in; otherwise entries iterate by name.

A registry whose names must be known without importing its modules (the CLI lists the suites for its parser and must
start in milliseconds) is `declared`: its names are read from the source, from the decorators `@SUITES.register("a")`
(string literals only), and looking one up imports only the module that declares it.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


class Registry(Mapping):
    def __init__(self, kind: str, package: str | None = None, *, modules: tuple[str, ...] | None = None,
                 declared: str | None = None):
        if (package is None) == (modules is None):
            raise ValueError(f"a registry of {kind}s scans one package or names its modules, not both or neither")
        if declared is not None and package is None:
            raise ValueError(f"a declared registry of {kind}s reads the decorators of one package's modules")
        self.kind, self.package, self.modules, self.declared = kind, package, modules, declared
        self._entries: dict[str, object] = {}
        self._loaded = False
        self._declared: dict[str, str] | None = None

    def register(self, *names: str) -> Callable[[T], T]:
        if not names:
            raise ValueError(f"a {self.kind} registers under at least one name")

        def add(entry: T) -> T:
            for name in names:
                held = self._entries.get(name)
                if held is not None and _qualname(held) != _qualname(entry):
                    raise ValueError(
                        f"{self.kind} {name!r} is registered twice: {_qualname(held)} and {_qualname(entry)}"
                    )
                self._entries[name] = entry
            return entry

        return add

    def load(self) -> None:
        if self._loaded:
            return
        if self.declared is not None:
            for module in sorted(set(self.declared_names().values())):
                importlib.import_module(module)
        elif self.modules is not None:
            for module in self.modules:
                importlib.import_module(module)
        else:
            package = importlib.import_module(self.package)  # and its subpackages (fidelity.oracle.deepseek)
            for module in sorted(m.name for m in pkgutil.walk_packages(package.__path__, f"{self.package}.")):
                importlib.import_module(module)
        self._loaded = True

    def declared_names(self) -> dict[str, str]:
        """name -> the module whose `@<declared>.register(...)` declares it, read from the source, nothing imported."""
        if self._declared is None:
            spec = importlib.util.find_spec(self.package)
            found: dict[str, str] = {}
            for info in sorted(pkgutil.iter_modules(spec.submodule_search_locations), key=lambda m: m.name):
                folder = Path(info.module_finder.path)
                path = folder / info.name / "__init__.py" if info.ispkg else folder / f"{info.name}.py"
                module = f"{self.package}.{info.name}"
                for name in _declared_in(path, self.declared):
                    if name in found:
                        raise ValueError(f"{self.kind} {name!r} is declared twice: in {found[name]} and {module}")
                    found[name] = module
            self._declared = found
        return self._declared

    def __getitem__(self, name: str):
        if self.declared is not None:
            module = self.declared_names()[name]
            importlib.import_module(module)
            if name not in self._entries:
                raise LookupError(f"{module} declares {self.kind} {name!r} but registered nothing under it")
            return self._entries[name]
        self.load()
        return self._entries[name]

    def __contains__(self, name) -> bool:
        if self.declared is not None:
            return name in self.declared_names()
        return super().__contains__(name)

    def __iter__(self) -> Iterator[str]:
        if self.declared is not None:
            return iter(sorted(self.declared_names()))
        self.load()
        if self.modules is None:
            return iter(sorted(self._entries))
        rank = {m: i for i, m in enumerate(self.modules)}

        def module_of(name):
            return getattr(getattr(self._entries[name], "defined_by", self._entries[name]), "__module__", None)

        return iter(
            sorted(self._entries, key=lambda name: rank.get(module_of(name), len(rank)))
        )  # stable: as registered

    def __len__(self) -> int:
        if self.declared is not None:
            return len(self.declared_names())
        self.load()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<Registry of {self.kind}s from {self.package or ', '.join(self.modules)}: {', '.join(self)}>"


def _declared_in(path: Path, registry: str) -> list[str]:
    """The names in the decorators `@<registry>.register("a", ...)` of a module's source."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        for dec in getattr(node, "decorator_list", ()):
            if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == "register"
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == registry):
                if dec.keywords or not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in dec.args):
                    raise ValueError(f"{path}:{dec.lineno}: {registry}.register takes string literals only (its names "
                                     f"are read from the source, without importing the module)")
                names += [a.value for a in dec.args]
    return names


def _qualname(entry) -> str:
    entry = getattr(entry, "defined_by", entry)  # an entry object (a `GateKind`) names the function it wraps
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', repr(entry))}"


# config.json "architectures"[0] -> the oracle `Family` class that computes it
ARCHITECTURES = Registry("architecture", "fidelity.oracle")

# gate.toml section -> the `engine.gates.kinds.GateKind` that runs it; in this order (the order `fidelity gate`
# runs them)
GATES = Registry("gate", modules=("fidelity.engine.gates.oracle_kl", "fidelity.engine.gates.invariance",
                                  "fidelity.engine.bench", "fidelity.suites.gate"))

# safetensors format claimers, in claim order: each takes the stored tensors it understands from those left; native last
CLAIMERS = Registry("format claimer", modules=("fidelity.packs.exl3.layouts", "fidelity.packs.compressed",
                                               "fidelity.packs.fp4", "fidelity.packs.fp8", "fidelity.packs.native"))

# `fidelity suite run NAME` -> a callable taking the suite's options and returning its `suites.runner.Suite`; declared,
# so the CLI's parser lists the suites without importing them
SUITES = Registry("suite", "fidelity.suites", declared="SUITES")
