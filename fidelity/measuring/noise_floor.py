"""The floors compare sets the packs against. The noise floor: the reference re-run with a tiny seeded perturbation of
every attention and MLP output, about one bf16 rounding step (`perturbed_oracle`, `Perturbation`), says what KL means
"indistinguishable from the reference". The numerics floor: the reference under its family's other numerics
(`other_numerics`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..numerics import DEFAULT_NUMERICS
from ..oracle import parallel
from ..oracle.families import family_for

NOISE_REL = 2.0 ** -8   # one bf16 rounding step is at most 2^-8 relative (half of its 2^-7 spacing near 1)


def perturbed_oracle(pack, device: str = "cpu", seed: int = 0, rel: float = NOISE_REL, numerics: str = DEFAULT_NUMERICS,
                     settings=None):
    """An Oracle whose every layer's attention and MLP outputs are multiplied by (1 + rel * u), u ~ U(-1, 1), from a
    generator seeded per (seed, layer, role): a reproducible stand-in for bf16 rounding of each module output. The
    perturbation is the last stage of the oracle's load chain (`LoadChain.layer`), so prefetch and sharding run below
    it unchanged."""
    return parallel.make_oracle(pack, device, settings or parallel.RunSettings(), layer=(Perturbation(seed, rel),),
                                numerics=numerics)


@dataclass(frozen=True)
class Perturbation:
    """A load-chain layer transform: wraps the sub-blocks each layer class declares by role in its `SUB_BLOCKS`
    (role -> attribute; DeepSeek V4/V4.1 name their MLP `ffn`)."""

    seed: int = 0
    rel: float = NOISE_REL

    def __call__(self, i: int, layer):
        for role, attr in sub_blocks(layer).items():
            setattr(layer, attr, _perturb(getattr(layer, attr), self.seed * 1_000_003 + 2 * i + NOISE_ROLES.index(role),
                                          self.rel))
        return layer


NOISE_ROLES = ("attention", "mlp")   # the order fixes each role's seed offset


def sub_blocks(layer) -> dict[str, str]:
    """The layer's {role: attribute} for every role in NOISE_ROLES, each a callable; a clear error otherwise."""
    name = type(layer).__qualname__
    roles = getattr(type(layer), "SUB_BLOCKS", None)
    if not roles:
        raise ConfigError(f"the noise floor cannot perturb layer class {type(layer).__module__}.{name}: it declares "
                          f"no SUB_BLOCKS (role -> attribute for roles {list(NOISE_ROLES)})")
    missing = [r for r in NOISE_ROLES if r not in roles or not callable(getattr(layer, roles[r], None))]
    if missing:
        raise ConfigError(f"the noise floor cannot perturb layer class {type(layer).__module__}.{name}: roles "
                          f"{missing} are not declared in its SUB_BLOCKS {roles} or name no callable attribute")
    return {r: roles[r] for r in NOISE_ROLES}


def _perturb(fn, seed: int, rel: float):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        g = torch.Generator(device="cpu").manual_seed(seed)
        u = torch.rand(out.shape, generator=g, dtype=out.dtype).to(out.device).mul_(2).sub_(1)
        return out + out * u * rel
    return wrapped


def other_numerics(pack, numerics: str) -> str | None:
    """The numerics the numerics floor sets against `numerics` ("exact" <-> "deepseek"), or None where the pack's
    family defines only one."""
    other = "deepseek" if numerics == "exact" else "exact"
    family = family_for(pack.config)
    family.resolve_names(pack.names())
    try:
        family.set_numerics(other, pack)
    except ConfigError:
        return None
    return other
