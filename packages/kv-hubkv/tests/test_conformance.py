"""Every object kv-hubkv's registered methods are made of goes through its kvcore conformance suite.

HubKV is a scorer wrapper over a base method that another package registers (kv-baselines' SnapKV, H2O, KVzip and
FastKVzip), so the scorers here are the registered methods' own ``HubKV`` scorers, taken from ``kvcore.registry``
builds (method packages never import each other); the compressors are the registered methods themselves. The
selector and store are the base's (kvcore's ``TopKSelector`` / ``DenseStore``, covered by kvcore's suites); the base
scorers are covered by kv-baselines' suites. HubKV over toy bases (a shifted negative base, declared extras) is in
test_hubkv_scorer.py. The coverage test at the end compares all this with what the registered methods use.
"""

import dataclasses
import sys

import torch

from kv_hubkv import HubKV
from kv_hubkv.registry import METHODS
from kvcore import Budget, Compressor, registry
from kvcore.testing.cases import RegisteredMethods, ScorerCases, methods_run, objects, parametrize_cases

KVZIP_EXTRA = "kvzip_scores"  # kv-baselines' KVzipScorer reads it; kv-hf's reconstruction pass supplies it


def kvzip_extras(shapes):
    """Context-reconstruction scores for a KVzip base: attention masses in [0, 1], ``[B, Hkv, T]``."""
    g = torch.Generator().manual_seed(shapes["seed"])
    return {KVZIP_EXTRA: torch.rand(shapes["B"], shapes["Hkv"], shapes["T"], generator=g)}


def registered_scorer(name: str) -> HubKV:
    """The scorer of the registered method ``name``, with a ratio for contexts that carry no budget (the
    Compressor passes its budget in ``ctx.budget``; the scorer suite's contexts have none)."""
    return dataclasses.replace(registry.build(name, Budget(ratio=0.5)).scorer, default_ratio=0.5)


class ScorerSuite(ScorerCases):
    """This package's scorer cases (the coverage test reads its subclasses)."""


class RegisteredSuite(RegisteredMethods):
    """The registered methods ``methods`` (names), each built by the registry at ``budget``."""


pytest_generate_tests = parametrize_cases


# -- scorers ----------------------------------------------------------------------------------------------------
class TestHubKVOverSnapKV(ScorerSuite):
    cases = objects(snapkv=lambda: registered_scorer("hubkv-snapkv"))


class TestHubKVOverH2O(ScorerSuite):
    cases = objects(h2o=lambda: registered_scorer("hubkv-h2o"))


class TestHubKVOverKVzip(ScorerSuite):
    cases = objects(kvzip=lambda: registered_scorer("hubkv-kvzip"))

    def make_extras(self, shapes):
        return kvzip_extras(shapes)


def untrained_fastkvzip(scorer: HubKV) -> HubKV:
    """HubKV over FastKVzip with untrained gates built for the drawn shapes (the registered method's shipped gate
    takes SmolLM2-135M's shapes only); the gate source is taken from the base's own module, not imported."""
    untrained = sys.modules[type(scorer.base).__module__].UntrainedGates(seed=3)
    return dataclasses.replace(scorer, base=dataclasses.replace(scorer.base, gate=untrained))


class TestHubKVOverFastKVzip(ScorerSuite):
    cases = objects(fastkvzip=lambda: untrained_fastkvzip(registered_scorer("hubkv-fastkvzip")))


# -- the registered methods -------------------------------------------------------------------------------------
class TestHubKVMethods(RegisteredSuite):
    methods = ("hubkv", "hubkv-snapkv", "hubkv-h2o")
    budget = Budget(ratio=0.5)


class TestHubKVOverKVzipMethod(RegisteredSuite):
    """KVzip's budget is global: the suite selects over its one layer through ``compress_layers``."""

    methods = ("hubkv-kvzip",)
    budget = Budget(ratio=0.5)

    def make_extras(self, shapes):
        return kvzip_extras(shapes)


class TestHubKVOverFastKVzipMethod(RegisteredSuite):
    """The registered ``hubkv-fastkvzip`` with the gate shipped for SmolLM2-135M: layers of that model's shapes."""

    methods = ("hubkv-fastkvzip",)
    budget = Budget(ratio=0.5)

    def layer_shapes(self, c):
        gate = c.scorer.base.gate.resolve(0, 0, 0)
        return {"kv_heads": (gate.num_kv_heads,) * 2, "head_dims": (gate.head_dim,), "groups": (3,)}


# -- coverage ---------------------------------------------------------------------------------------------------
def parts(c: Compressor) -> dict[str, type]:
    return {"scorer": type(c.scorer), "selector": type(c.selector), "store": type(c.new_store())}


def test_suites_cover_every_registered_method():
    """Every method kv-hubkv registers goes through ``CompressorTests`` here; HubKV over each base a registered
    method wraps goes through ``ScorerTests`` here; every other scorer / selector / store class of those methods (at
    a ratio and a token budget) is the base's: kvcore's or another package's, covered by that package's suites."""
    ours = {m.name for m in METHODS}
    found = {name: m for name, m in registry.discover().items() if name in ours}
    assert set(found) == ours, f"not discovered: {sorted(ours - set(found))}"
    tested = methods_run([RegisteredSuite])
    assert tested == ours, f"registered methods without CompressorTests: {sorted(ours - tested)}"
    built = [m.build(b) for m in found.values() for b in (Budget(ratio=0.5), Budget(tokens=16))]
    used = {(part, cls) for c in built for part, cls in parts(c).items() if cls.__module__.startswith("kv_hubkv")}
    scorers = [make() for cls in ScorerSuite.__subclasses__() for make in cls.cases.values()]
    covered = {("scorer", type(s)) for s in scorers}
    assert used <= covered, f"classes of registered methods no suite runs on: {sorted(used - covered, key=str)}"
    wrapped = {type(c.scorer.base) for c in built}
    assert wrapped == {type(s.base) for s in scorers}, "a registered base that HubKV's scorer suite does not wrap"
