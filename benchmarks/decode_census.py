"""Census of a decode: the Triton kernel variants a GPU would compile, the host reads of tensor values, and the
aten operations that do work (views excluded; each is a kernel launch or more on a GPU), per decode step.

**Launch variants.**
A Triton kernel is compiled once per *variant*: its constexprs, launch options, argument dtypes and the
specialisations Triton makes on a GPU (integers equal to 1 become constants, integers and pointers divisible by 16
are marked). A variant that depends on something growing with the cache -- a length passed as a constexpr, a
block count, a tier that appears later -- compiles again during decoding, seconds each time on a GPU. This tool
finds such variants without a GPU: it runs a tiny random Llama through the HF adapter on the CPU with every
method's Triton path forced on (Triton's interpreter computes the kernels), records the variant key of every
launch, and reports per method and kernel the variants seen during the prefill and the decode, and which decode
step first needed each new one.

Operations per step are also given over the first and the last tenth of the decode: a method whose cost per step
grows with what it has decoded shows it there.

Reading: a method whose decode variants keep appearing late (new ones in the last third of the steps) recompiles
as it decodes; a bounded set that is complete after the first steps is compiled once per process.

**Host reads.** Every call that reads a tensor's value on the host -- ``item``, ``tolist``, ``int()``/``bool()``/
``float()`` of a tensor, ``nonzero``, boolean-mask indexing, ``unique``, ``repeat_interleave`` without
``output_size``, a copy to the CPU -- waits on a GPU for every kernel queued before it (a host sync), so a decode
step with a few per layer runs at the launch latency of the whole model. The census counts them per decode step
and names the call site (the first frame in a kv* package, else the library that made the call). On this CPU
every tensor is a CPU tensor, so a read of a tensor that a GPU run would also keep on the host is counted too:
the figures are an upper bound on the GPU's syncs, and the sites are where to look (code that reads only on the
CPU, such as KIVI's value-flush scale rounding, is counted here too). The decode runs with the per-step value
checks off, as on a GPU (:func:`kvcore.value_checks`; ``--value-checks`` turns them on).

Usage::

    python benchmarks/decode_census.py                       # DynamicCache, full, kivi-2, hqekv-2, hex-3, SEKV
    python benchmarks/decode_census.py --methods full,kivi-2 --steps 8 --no-triton   # host reads only, fast
    python benchmarks/decode_census.py --methods hqekv-2 --tokens 300 --steps 160 --verbose
    python benchmarks/decode_census.py --host-time --layers 8 --steps 64    # host ms per step, no census

**Host time** (``--host-time``): a small model's decode on a GPU is host-bound -- the GPU waits on the Python,
the tensor operations' dispatch and the launches of each layer. ``--host-time`` times each decode step on this
CPU with the Triton paths forced on, less the time Triton's interpreter spends computing the kernels, and prints
``DynamicCache``'s time over each method's: the decode-rate ratio a host-bound GPU would show.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse
import gc
import importlib
import inspect
import statistics
import time
from collections import Counter, defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache
from triton.runtime.interpreter import InterpretedFunction

import kv_hf
from kv_hf.testing import tiny_model
from kvbench.budgets import parse_budget
from kvbench.cli import _count  # whole-number arguments with a one-line error
from kvcore import registry, value_checks
from kvcore.testing.host_reads import HostReads, call_site

# every module that calls kvcore.dispatch.use_triton, the one decision "Triton or the PyTorch reference" by the
# tensor's device, through its own binding of the name (module, name): patching each binding forces every call site
# (tests/test_dispatch_point.py checks the list against the sources)
DISPATCH = (
    ("kvcodec.kernels.dispatch", "use_triton"),
    ("kvcodec.decode_v2", "use_triton"),
    ("kvcodec.attention", "use_triton"),
    ("kv_baselines.quant.kivi_store", "use_triton"),
    ("kv_baselines.quant.kivi_decode", "use_triton"),
    ("kv_baselines.quant.token_quant", "use_triton"),
    ("kv_hqekv.kernels.dispatch", "use_triton"),
    ("kv_hqekv.kernels.folded", "use_triton"),
    ("kv_hqekv.attention", "use_triton"),
    ("kv_hqekv.importance", "use_triton"),
    ("kv_hqekv.window", "use_triton"),
    ("kv_hex.kernels.dispatch", "use_triton"),
    ("kv_sekv.kernels.dispatch", "use_triton"),
    ("kv_hubkv.refine", "use_triton"),
    ("kv_hubkv.refiner", "use_triton"),
)
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def force_triton() -> list[str]:
    """Make every dispatch point above take the Triton path for any tensor; the modules that could be patched."""
    patched = []
    for module, name in DISPATCH:
        try:
            mod = importlib.import_module(module)
        except ImportError:  # a method package that is not installed
            continue
        if not hasattr(mod, name):
            raise RuntimeError(f"{module} has no {name}: update DISPATCH in {__file__}")
        setattr(mod, name, lambda t: True)
        patched.append(module)
    return patched


def variant_key(fn, args: tuple, kwargs: dict, unspecialised=()) -> tuple:
    """What a GPU compile is keyed on: constexprs, options, dtypes and Triton's integer/pointer specialisations
    (none for the integers named in the kernel's ``do_not_specialize``, ``unspecialised``)."""
    names = list(inspect.signature(fn).parameters)
    bound = dict(zip(names, args))
    bound.update(kwargs)
    key = []
    for name in names:
        value = bound.get(name)
        if isinstance(value, torch.Tensor):
            key.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, bool) or not isinstance(value, int):
            key.append((name, repr(value)))  # constexprs and floats: a float argument is typed, not valued
        elif name in unspecialised:
            key.append((name, "int"))
        else:
            key.append((name, "1" if value == 1 else ("16k" if value % 16 == 0 else "int")))
    key += [(k, repr(kwargs[k])) for k in _OPTIONS if k in kwargs]
    return tuple(key)


class Census:
    """Launch records: ``phase -> kernel -> {variant key: first step}``."""

    def __init__(self) -> None:
        self.phase, self.step, self.in_kernel = "prefill", 0, False
        self.seen: dict[str, dict[tuple, tuple[str, int]]] = defaultdict(dict)
        self.launches: dict[str, int] = defaultdict(int)
        self.ops = 0  # aten operations during the decode
        self.step_ops: Counter = Counter()  # decode step -> aten operations
        self.op_sites: Counter | None = None  # (site, op) -> count, with --ops
        self.reads = HostReads(sites=True)  # entered for the decode only
        self.timing = False  # --host-time: launches are only counted and timed, nothing else recorded
        self.kernel_s = 0.0  # seconds inside interpreted kernels (subtracted from a step's wall time)

    def record(self, fn, args: tuple, kwargs: dict, unspecialised=()) -> None:
        kw = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        name = f"{fn.__module__.split('.')[0]}.{fn.__name__}"
        self.launches[name] += 1
        self.seen[name].setdefault(variant_key(fn, args, kw, unspecialised), (self.phase, self.step))


CURRENT: list[Census] = []


def install() -> None:
    """Record every interpreted launch into ``CURRENT[-1]``."""
    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        if not CURRENT:
            return original(self, *args, **kwargs)
        census = CURRENT[-1]
        if census.timing:
            census.launches[self.fn.__name__] += 1
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                census.kernel_s += time.perf_counter() - t0
        names = [p if isinstance(p, str) else self.arg_names[p] for p in self.kwargs.get("do_not_specialize") or ()]
        census.record(self.fn, args, kwargs, names)
        census.in_kernel = census.reads.paused = True  # the interpreter's own reads are not the caller's
        try:
            return original(self, *args, **kwargs)
        finally:
            census.in_kernel = census.reads.paused = False

    InterpretedFunction.run = run


def tiny_llama(layers: int, seed: int = 0):
    """kv_hf's tiny random Llama (GQA 4:2) in float32 with head_dim 64 (SmolLM2's; KIVI's 32-channel value groups
    need it), a 512-token vocabulary and ``layers`` layers."""
    return tiny_model(
        "llama", seed=seed, head_dim=64, vocab_size=512, num_hidden_layers=layers, max_position_embeddings=4096
    )


# aten operations that only make a view or read metadata: no kernel on a GPU
_METADATA_OPS = frozenset(
    f"aten.{name}"
    for name in (
        "view", "_unsafe_view", "t", "transpose", "expand", "unsqueeze", "squeeze", "select", "slice", "as_strided",
        "alias", "detach", "permute", "split", "unbind", "_reshape_alias", "lift_fresh", "empty", "diagonal",
        "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "expand_as", "view_as",
    )
)  # fmt: skip


class _OpCounter(TorchDispatchMode):
    """Counts the aten operations of the decode that do work (each one a kernel launch or more on a GPU; views and
    metadata reads are not counted), not those of the Triton kernels the interpreter runs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        census = CURRENT[-1] if CURRENT else None
        if (
            census is not None
            and census.phase == "decode"
            and not census.in_kernel
            and func.overloadpacket.__qualname__ not in _METADATA_OPS
            and str(func.overloadpacket) not in _METADATA_OPS
        ):
            census.ops += 1
            census.step_ops[census.step] += 1
            if census.op_sites is not None:
                census.op_sites[(call_site(), str(func))] += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def tiny_sekv(model):
    """SEKV at its 10 % budget with an untrained router sized for ``model`` (the shipped router is SmolLM2's) and a
    window and spans scaled to a 200-token prompt, so spans are summarised and expanded."""
    import kv_sekv

    c = model.config
    config = kv_sekv.SEKVConfig(window=32, min_span=8, max_rank=8, proj_dim=8)
    router = kv_sekv.SEKVRouter.untrained(
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        config=config,
    )
    return kv_sekv.sekv(router=router, config=config)


def _prefilled(method: str, model, ids: torch.Tensor):
    """``(cache, next token, its position)`` after prefilling ``ids`` through ``method`` (``dynamic``: transformers'
    ``DynamicCache``)."""
    if method == "dynamic":
        cache = DynamicCache()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[:, -1].argmax(-1, keepdim=True), torch.tensor([[ids.shape[1]]])
    name, _, budget = method.partition("@")
    spec = parse_budget(budget, "--methods budget").budget() if budget else None
    compressor = tiny_sekv(model) if name == "sekv-tiny" else registry.build(name, spec, registry.discover())
    cache = kv_hf.compressed_cache(model, compressor)
    tok = kv_hf.prefill(model, cache, ids).argmax(-1)[:, None]
    return cache, tok, cache.next_positions()[:, None]


@torch.no_grad()
def host_time_of(method: str, model, ids: torch.Tensor, steps: int, warmup: int = 4) -> tuple[list[float], float]:
    """``(host ms of each decode step, Triton launches per step)``: each step's wall time less the time the
    interpreter spent computing its kernels, i.e. the Python, tensor operations and launch decisions a GPU's host
    would run for that step (the tensor operations here run on the CPU over small tensors, so they cost about what
    dispatching them costs). ``warmup`` steps first, not timed; no counters installed while timing."""
    census = Census()
    census.timing = True
    CURRENT.append(census)
    try:
        cache, tok, pos = _prefilled(method, model, ids)
        times = []
        with value_checks(False):
            for step in range(warmup + steps):
                if step == warmup:
                    census.launches.clear()
                census.kernel_s = 0.0
                # the interpreter leaves many reference cycles: collected before the step, not during it (a
                # collection triggered inside the step would bill the interpreter's garbage to the host)
                gc.collect()
                gc.disable()
                try:
                    t0 = time.perf_counter()
                    out = model(
                        input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1
                    )
                    tok, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos + 1
                    elapsed = time.perf_counter() - t0
                finally:
                    gc.enable()
                if step >= warmup:
                    times.append(1e3 * (elapsed - census.kernel_s))
    finally:
        CURRENT.remove(census)
    return times, sum(census.launches.values()) / steps


@torch.no_grad()
def census_of(method: str, model, ids: torch.Tensor, steps: int, ops: bool = False, checks: bool = False) -> Census:
    """Prefill ``ids`` and decode ``steps`` greedy tokens through ``method`` (``dynamic``: transformers'
    ``DynamicCache``, the reference), recording every launch, host read and aten operation."""
    census = Census()
    census.op_sites = Counter() if ops else None
    CURRENT.append(census)
    cache, tok, pos = _prefilled(method, model, ids)
    census.phase = "decode"
    with _OpCounter(), census.reads, value_checks(checks):
        for step in range(1, steps + 1):
            census.step = step
            out = model(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
            tok, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos + 1
    return census


def report(method: str, census: Census, steps: int, verbose: bool, top: int) -> int:
    """Print the census; return the number of variants first needed in the last third of the decode."""
    late_from = steps - steps // 3 + 1
    late_total = 0
    print(f"\n## {method}")
    if census.seen:
        print("| kernel | launches | prefill variants | decode variants | first needed at decode steps | late |")
        print("|---|---|---|---|---|---|")
    for kernel in sorted(census.seen):
        seen = census.seen[kernel]
        pre = sum(1 for phase, _ in seen.values() if phase == "prefill")
        dec = sorted(step for phase, step in seen.values() if phase == "decode")
        late = sum(1 for s in dec if s >= late_from)
        late_total += late
        shown = ", ".join(map(str, dec[:12])) + (" ..." if len(dec) > 12 else "")
        print(f"| {kernel} | {census.launches[kernel]} | {pre} | {len(dec)} | {shown} | {late} |")
        if verbose:
            for key, (phase, step) in seen.items():
                print(f"    {phase} {step}: {key}")
    total = census.reads.total
    print(f"\naten operations doing work per decode step: {census.ops / steps:.0f}; host reads: {total / steps:.1f}")
    tenth = max(1, steps // 10)
    first = sum(census.step_ops[s] for s in range(1, tenth + 1)) / tenth
    last = sum(census.step_ops[s] for s in range(steps - tenth + 1, steps + 1)) / tenth
    print(f"operations per step over the first {tenth} decode steps: {first:.0f}; over the last {tenth}: {last:.0f}")
    if total:
        print("| call site | operation | per step |")
        print("|---|---|---|")
        for (site, op), n in census.reads.by_site.most_common(top):
            print(f"| {site} | {op} | {n / steps:.2f} |")
    if census.op_sites:
        print("| call site | aten operation | per step |")
        print("|---|---|---|")
        for (site, op), n in census.op_sites.most_common(top):
            print(f"| {site} | {op} | {n / steps:.2f} |")
    return late_total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--methods",
        default="dynamic,full,kivi-2,hqekv-2,hex-3,sekv-tiny",
        help="registry names, name@budget, dynamic (transformers' DynamicCache) or sekv-tiny (SEKV with an untrained "
        "router for the tiny model) (default: %(default)s)",
    )
    p.add_argument("--tokens", type=_count(2), default=200, help="prompt tokens (default: %(default)s)")
    p.add_argument("--steps", type=_count(1), default=96, help="decode steps (default: %(default)s)")
    p.add_argument("--layers", type=_count(1), default=2, help="model layers (default: %(default)s)")
    p.add_argument("--verbose", action="store_true", help="print every variant key")
    p.add_argument("--no-triton", action="store_true", help="keep the CPU paths (host reads only; much faster)")
    p.add_argument(
        "--value-checks", action="store_true", help="run the per-step value checks (a GPU skips them by default)"
    )
    p.add_argument("--ops", action="store_true", help="also list the aten operations by call site")
    p.add_argument("--top", type=int, default=15, help="call sites shown per method (default: %(default)s)")
    p.add_argument(
        "--host-time",
        action="store_true",
        help="instead of the census, time each decode step's host work (wall time less the interpreted kernels)",
    )
    p.add_argument(
        "--rounds", type=_count(1), default=3, help="--host-time: rounds over the methods (default: %(default)s)"
    )
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    methods_found = registry.discover()
    for m in methods:
        if m not in ("dynamic", "sekv-tiny"):
            registry.get(m.partition("@")[0], methods_found)  # unknown names fail before any work
    if not args.no_triton:
        print(f"Triton forced on in: {', '.join(force_triton())}")
    install()
    print(f"tiny random Llama, {args.layers} layers; prompt {args.tokens} tokens; {args.steps} decode steps")
    model = tiny_llama(args.layers)
    ids = torch.randint(10, 500, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    if args.host_time:
        return host_time_table(methods, model, ids, args.steps, args.rounds)
    late = 0
    for m in methods:
        late += report(
            m, census_of(m, model, ids, args.steps, args.ops, args.value_checks), args.steps, args.verbose, args.top
        )
    print(f"\nvariants first needed in the last third of the decode: {late}")
    return 1 if late else 0


def host_time_table(methods: list[str], model, ids: torch.Tensor, steps: int, rounds: int) -> int:
    """Print each method's host milliseconds per decode step (mean over the steps, so periodic work such as a
    re-plan counts at its rate; median over ``rounds`` alternating rounds), its Triton launches per step, and
    ``DynamicCache``'s host time over its own: the decode-rate ratio a GPU that only waits on the host would show."""
    torch.set_num_threads(1)
    per: dict[str, list[float]] = defaultdict(list)
    typical: dict[str, list[float]] = defaultdict(list)
    launches: dict[str, float] = {}
    for _ in range(rounds):
        for m in methods:
            times, launches[m] = host_time_of(m, model, ids, steps)
            per[m].append(statistics.fmean(times))
            typical[m].append(statistics.median(times))
    ms = {m: statistics.median(v) for m, v in per.items()}
    base = ms.get("dynamic")
    print(f"\nhost ms per decode step (mean of {steps} steps; median of {rounds} rounds; one torch thread)")
    print("| cache | host ms / step | per round | median step ms | Triton launches / step | DynamicCache / this |")
    print("|---|---|---|---|---|---|")
    for m in methods:
        ratio = f"{base / ms[m]:.2f}x" if base else "–"
        rounds_ms = ", ".join(f"{x:.2f}" for x in per[m])
        med = statistics.median(typical[m])
        print(f"| {m} | {ms[m]:.2f} | {rounds_ms} | {med:.2f} | {launches[m]:.0f} | {ratio} |")
    print("(median step: a step without periodic work such as a re-plan; the mean counts that work at its rate)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
