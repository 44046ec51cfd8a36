"""pytest plugin: compile every Triton launch of a test run for sm_90 (H100/H200), without a GPU.

Each ``kernel[grid](...)`` the tests make is compiled for ``cuda:90`` with the Triton that is importable (use the
version the GPU machines run) instead of being run: compile errors and each variant's registers, stack (spills)
and shared memory are printed at the end (``cuobjdump --dump-resource-usage``, which Triton's wheel carries). No
kernel computes anything, so the tests themselves fail after their first launch; only the report matters.
Arguments are specialised as Triton does on a GPU (16-divisible integers and pointers marked, integers equal to 1
made constants, except the integers a kernel lists in ``do_not_specialize``), which is what exposed a layout-pass
failure that plain compilation missed.

Usage (Triton 3.6, as on the device machines, installed beside the workspace's)::

    uv pip install --target /tmp/triton36 --no-deps triton==3.6.0
    PYTHONPATH=/tmp/triton36:benchmarks python -m pytest -q -p sm90_compile_plugin -m "not hypothesis" \\
        core/kvcodec/tests/test_attention_triton.py packages/kv-hqekv/tests/test_kernels.py
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile

import torch
import triton
import triton.knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
REPORT: dict[str, str] = {}

# kernels must be JIT functions, not the interpreter's wrappers, whatever the test configuration sets
type(triton.knobs.runtime).interpret = property(lambda self: False, lambda self, value: None)


def compile_sm90(kernel: JITFunction, runtime_args: dict, constexprs: dict, **options):
    """Compile ``kernel`` for sm_90 with the run-time arguments' types and Triton's GPU specialisations."""
    names = list(inspect.signature(kernel.fn).parameters)
    # integers the kernel lists in do_not_specialize get neither specialisation (as on a GPU)
    plain = {names[p] if isinstance(p, int) else p for p in (kernel.do_not_specialize or ())}
    signature, attrs, consts = {}, {}, {(names.index(k),): v for k, v in constexprs.items()}
    for name, value in runtime_args.items():
        i = names.index(name)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int) and name in plain:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, int):
            if value == 1:
                signature[name], consts[(i,)] = "constexpr", 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"argument {name}: {type(value).__name__}")
    for name in constexprs:
        signature[name] = "constexpr"
    source = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump(compiled, flag: str) -> str:
    """``cuobjdump <flag>`` (the one Triton's wheel carries) of a compiled kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def resources(compiled) -> str:
    """``REG:.. STACK:.. SHARED:..`` of a compiled kernel."""
    out = _cuobjdump(compiled, "--dump-resource-usage")
    fields = " ".join(line.strip() for line in out.splitlines() if "REG" in line).split()
    return " ".join(x for x in fields if x.split(":")[0] in ("REG", "STACK", "SHARED"))


SASS = False  # also report the machine code's loop (set by sm90_resources.py --sass)
_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_BRANCH = re.compile(r"BRA\s+0x([0-9a-f]+)")  # cuobjdump prints branch targets as addresses
_PREDICATED = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+@!?U?P")  # an instruction under a predicate (a conditional branch)


def _paths(body: list[tuple[int, str, str]]) -> tuple[int, int]:
    """Fewest and most instructions a warp issues from a loop's first instruction to its backward branch (the last
    of ``body``): the loop's forward branches (``if`` inside it) split it into blocks, and each trip takes one path
    through them."""
    head, tail = body[0][0], body[-1][0]
    at = {a: i for i, (a, _, _) in enumerate(body)}
    lo, hi = {head: 0}, {head: 0}  # instructions issued before reaching an address, over the paths reaching it

    def reach(a: int, low: int, high: int) -> None:
        lo[a], hi[a] = min(lo.get(a, low), low), max(hi.get(a, high), high)

    starts = {head} | {a for i, (a, o, _) in enumerate(body) if i and body[i - 1][1] == "BRA"}
    for _, op, line in body:
        b = _BRANCH.search(line) if op == "BRA" else None
        if b and head < int(b.group(1), 16) <= tail:
            starts.add(int(b.group(1), 16))
    for start in sorted(starts):  # blocks in address order: forward edges only (the back edge ends the trip)
        if start not in lo:
            continue
        n, i = 0, at[start]
        while True:
            a, op, line = body[i]
            n += 1
            if a == tail:
                reach(-1, lo[start] + n, hi[start] + n)
                break
            b = _BRANCH.search(line) if op == "BRA" else None
            if b and a < int(b.group(1), 16) <= tail:
                reach(int(b.group(1), 16), lo[start] + n, hi[start] + n)
                if not _PREDICATED.match(line):
                    break  # an unconditional jump: no fall-through
            if body[i + 1][0] in starts:
                reach(body[i + 1][0], lo[start] + n, hi[start] + n)
                break
            i += 1
    return lo[-1], hi[-1]


def sass_loops(compiled) -> str:
    """Each backward branch of the kernel's machine code (a loop: the compiled ``for`` over tiles) as
    ``loop: N instr (B BAR, M MMA, S LDS/STS)``: the instructions every warp issues per trip, the block-wide barriers
    among them (Triton's register-layout conversions through shared memory), the matrix instructions and the
    shared-memory loads and stores -- counted over the whole loop body; where an ``if`` inside the loop splits it,
    ``paths A-B`` adds the fewest and most instructions one trip issues. Then the kernel's total. Read with
    ``cuobjdump --dump-sass``."""
    ins = []  # (address, opcode, line)
    for line in _cuobjdump(compiled, "--dump-sass").splitlines():
        m = _INSTR.match(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), line))
    out = []
    for addr, op, line in ins:
        b = _BRANCH.search(line) if op == "BRA" else None
        target = int(b.group(1), 16) if b else addr
        if target < addr:
            full = [x for x in ins if target <= x[0] <= addr]
            body = [o for _, o, _ in full]
            bars = sum(o == "BAR" for o in body)
            mma = sum(o in ("HMMA", "HGMMA", "IMMA") for o in body)
            shared = sum(o in ("LDS", "STS", "LDSM") for o in body)
            low, high = _paths(full)
            paths = f", paths {low}-{high}" if (low, high) != (len(body), len(body)) else ""
            out.append(f"loop: {len(body)} instr ({bars} BAR, {mma} MMA, {shared} LDS/STS{paths})")
    return "; ".join(out + [f"total {len(ins)} instr"])


def _run(self, *args, grid, warmup=False, **kwargs):
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    bound = dict(zip([p.name for p in self.params], args))
    bound.update(kwargs)
    constexprs = {p.name: bound[p.name] for p in self.params if p.is_constexpr}
    runtime = {p.name: bound[p.name] for p in self.params if not p.is_constexpr}
    key = f"{self.fn.__module__}.{self.fn.__name__} {sorted((k, str(v)) for k, v in constexprs.items())} {options}"
    if key not in REPORT:
        try:
            compiled = compile_sm90(self, runtime, constexprs, **options)
            REPORT[key] = "ok " + resources(compiled) + (f" | {sass_loops(compiled)}" if SASS else "")
        except Exception as e:  # every compile failure is reported, not raised
            REPORT[key] = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}"


JITFunction.run = _run


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    fails = {k: v for k, v in REPORT.items() if not v.startswith("ok")}
    write(f"sm_90 compile (Triton {triton.__version__}): {len(REPORT)} launch variants, {len(fails)} failed")
    for key, result in sorted(REPORT.items()):
        kernel, _, rest = key.partition(" ")
        write(f"  {kernel.rsplit('.', 1)[-1]}: {result}  {rest[:160]}")
