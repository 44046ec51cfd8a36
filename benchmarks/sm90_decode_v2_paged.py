"""Instructions per KV entry of the paged decode attention v2 kernel (kvcodec.kernels.triton_decode_v2_paged: vLLM's
block pool and block table, issue 43) against the contiguous v2 kernel, compiled for sm_90 without a GPU
(:mod:`sm90_compile_plugin`): Llama-3-8B's attention shape (32 query / 8 KV heads, head dim 128, GQA group 4),
float16, 32-token blocks (one KIVI key group per block, as kv_vllm's packed backend), 2 and 4 bits.

The paged kernel's loop walks logical blocks; one trip takes one of three paths: a packed block (``N / BLOCK_T``
folded tiles, the path every block but the open one takes), the open block (full-precision rows) or nothing (past
the sequence's end). ``sm90_compile_plugin.sass_loops`` gives only the fewest and most instructions per trip, so this
script enumerates the trip's paths through the loop's forward branches and reports the packed ones: the paths with
the code conversion's ``HFMA2`` (the ``fma.rn.f16x2`` that ends it; the open block's paths have none), fewest-most
(small predicated branches inside split them). **Warp instructions per entry** = fewest x warps / ``N``, as
``sm90_decode_v2.py`` reports the contiguous kernel's folded path (fewest x warps / ``BLOCK_T``).

Usage (Triton 3.6, as on the device machines)::

    uv pip install --target /tmp/triton36 --no-deps triton==3.6.0
    PYTHONPATH=/tmp/triton36:benchmarks python benchmarks/sm90_decode_v2_paged.py
"""

from __future__ import annotations

import argparse
from collections import Counter

import sm90_compile_plugin as sm90  # compiles instead of launching (patches Triton's JIT on import)
import torch

BUDGET = {2: 34, 4: 56}
"""Warp instructions per entry the 70 % goal allows on an H200 (docs/benchmarks.md, issue-rate bound)."""

_compiled: dict[str, object] = {}
_compile = sm90.compile_sm90


def _keep(kernel, runtime_args, constexprs, **options):  # the compiled kernels, for the path enumeration below
    c = _compile(kernel, runtime_args, constexprs, **options)
    _compiled[kernel.fn.__name__] = c
    return c


sm90.compile_sm90 = _keep


def trip_paths(compiled) -> list[tuple[int, Counter]]:
    """Every path one trip of the kernel's first loop takes through its forward branches: ``(instructions,
    opcode counts)``, from the loop's first instruction to its backward branch."""
    ins = []
    for line in sm90._cuobjdump(compiled, "--dump-sass").splitlines():
        m = sm90._INSTR.match(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), line))
    for addr, op, line in ins:
        b = sm90._BRANCH.search(line) if op == "BRA" else None
        if b and int(b.group(1), 16) < addr:
            body = [x for x in ins if int(b.group(1), 16) <= x[0] <= addr]
            break
    else:
        return []
    at = {a: i for i, (a, _, _) in enumerate(body)}
    tail = body[-1][0]
    out: list[tuple[int, Counter]] = []

    def walk(i: int, seen: Counter, n: int) -> None:
        if len(out) > 64:
            return
        while True:
            a, op, line = body[i]
            seen = seen + Counter([op])
            n += 1
            if a == tail:
                out.append((n, seen))
                return
            b = sm90._BRANCH.search(line) if op == "BRA" else None
            if b and a < int(b.group(1), 16) <= tail:
                walk(at[int(b.group(1), 16)], seen, n)
                if not sm90._PREDICATED.match(line):
                    return
            i += 1

    walk(0, Counter(), 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block", type=int, default=32, help="tokens per vLLM block (one key group)")
    ap.add_argument("--paths", action="store_true", help="also every path's instructions, HFMA2, PRMT, LOP3 and HMMA")
    args = ap.parse_args()
    from kvcodec.decode_v2 import PagedPackedKIVI
    from kvcodec.kernels.triton_decode_v2_paged import paged_decode_v2_triton

    g = torch.Generator().manual_seed(0)
    H, Hq, D, N, B = 8, 32, 128, args.block, 1
    nblk = args.tokens // N
    print(
        f"sm_90, Triton {sm90.triton.__version__}, float16, D {D}, {Hq}/{H} heads, {args.tokens} tokens, blocks of {N}"
    )
    print("| kernel | bits | warps | BLOCK_T | regs / spill | packed trip (instr) | other trips (open block, none) "
          "| warp instr / entry | per element | budget / entry |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for bits in (2, 4):
        P = D * bits // 8
        f16 = torch.float16
        cache = PagedPackedKIVI(
            kc=torch.randint(0, 256, (nblk, H, P, N), generator=g, dtype=torch.uint8),
            ks=torch.rand(nblk, H, D, 1, generator=g).to(f16), kz=torch.rand(nblk, H, D, 1, generator=g).to(f16),
            vc=torch.randint(0, 256, (nblk, H, P, N), generator=g, dtype=torch.uint8),
            vs=torch.rand(nblk, H, D // 32, N, generator=g).to(f16),
            vz=torch.rand(nblk, H, D // 32, N, generator=g).to(f16),
            tail_k=torch.randn(B, H, N, D, generator=g).to(f16), tail_v=torch.randn(B, H, N, D, generator=g).to(f16),
            block_table=torch.randperm(nblk, generator=g).to(torch.int32)[None], seq_lens=torch.tensor([nblk * N]),
            tail_lens=torch.tensor([N]), kbits=bits, vbits=bits, group=N, vgroup=32,
        )  # fmt: skip
        cache = PagedPackedKIVI(**{**cache.__dict__, "seq_lens": torch.tensor([(nblk - 1) * N + N // 2]),
                                   "tail_lens": torch.tensor([N // 2])})  # fmt: skip
        q = torch.randn(B, Hq, D, generator=g).to(f16)
        for warps in (4, 8):
            sm90.REPORT.clear()
            _compiled.clear()
            paged_decode_v2_triton(q, cache, 0.1, num_warps=warps, tensor_cores=True, asm=True)
            rep = next((v for k, v in sm90.REPORT.items() if "paged" in k.split(" ")[0]), "")
            if rep.startswith("FAIL"):
                print(f"| paged v2 | {bits} | {warps} | - | {rep[:200]} |")
                continue
            res = " ".join(x for x in rep.split()[1:] if x.startswith(("REG", "STACK")))
            paths = trip_paths(_compiled["_paged_decode_v2_kernel"])
            packed = sorted(n for n, c in paths if c["HFMA2"])  # the paths converting codes: a packed block
            rest = sorted({n for n, c in paths if not c["HFMA2"]}, reverse=True)
            per_entry = packed[0] * warps / N  # the fewest, as sm90_decode_v2.py counts the contiguous kernel's
            if args.paths:
                for n, c in paths:
                    ops = ", ".join(f"{c[o]} {o}" for o in ("HFMA2", "PRMT", "LOP3", "HMMA"))
                    print(f"|   path: {n} instr, {ops} |")
            print(f"| paged v2 | {bits} | {warps} | {min(32, N)} | {res} | {packed[0]}-{packed[-1]} | "
                  f"{', '.join(map(str, rest))} | "
                  f"{per_entry:.0f} | {per_entry * 32 / (2 * D):.2f} | {BUDGET[bits]} |")  # fmt: skip


if __name__ == "__main__":
    main()
