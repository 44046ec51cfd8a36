"""CPU cost of one SEKV router training step on SmolLM2-135M, by phase (SEKV §3.4, ``kv_lab.sekv``).

A step is: the teacher pass (full KV, no grad; records the prefix keys/values and the continuation queries), the
prefix surprisal and segmentation, the span preparation for every layer at once (coarse entries, span SVDs, gates
``g_φ``, reconstructions, the teacher's zoom targets), the student pass over the continuation, the backward and the
AdamW step. CPU time is the process's user + system time (``resource.getrusage``), so it counts every thread.

Run: ``uv run python benchmarks/sekv_train_step.py --steps 6 --threads 1`` (needs kvbench's offline SmolLM2 and
gensim's lee_background corpus). The first step is a warm-up and is not counted.

On a GPU (``--device cuda``) the phases are wall time with the device synchronised at each boundary;
``--random-model`` builds SmolLM2-135M's architecture with seeded random weights (float32, as the CLI trains) and
random token sequences, for a machine without the weights or the corpus (the time of a step depends on the shapes,
not on the weights).
"""

from __future__ import annotations

import argparse
import math
import platform
import resource
import time

import torch

from kv_lab.sekv import (
    TeacherRecord,
    TrainConfig,
    corpus_sequences,
    prepare_training,
    sekv_training,
    teacher_recording,
)
from kv_lab.sekv.cli import load_model, read_corpus
from kv_lab.sekv.loop import _segment
from kv_sekv import SEKVConfig, SEKVRouter
from kv_sekv.surprisal import surprisal_from_logits


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--random-model", action="store_true", help="SmolLM2's shapes, random weights and tokens")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    if a.random_model:
        from bench_hf_decode import random_smollm2

        model, model_id = random_smollm2(dev, torch.float32), "SmolLM2-135M shapes, random weights"
        g = torch.Generator().manual_seed(0)
        seqs = torch.randint(100, 10_000, ((a.steps + 1) * a.batch_size, a.seq_len), generator=g)
    else:
        model, tok, model_id = load_model("smollm2")
        model.to(dev)
        seqs = corpus_sequences(read_corpus(None), tok, a.seq_len)
    model.requires_grad_(False)
    if dev.type == "cuda":  # wall time, the device synchronised at each phase boundary

        def clock() -> float:
            torch.cuda.synchronize(dev)
            return time.perf_counter()
    else:
        clock = cpu_s
    unit = "CPU-s" if dev.type == "cpu" else "s"
    c = model.config
    cfg = SEKVConfig(window=64, budget=0.2)
    router = SEKVRouter.untrained(
        c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, cfg
    ).to(dev)
    opt = torch.optim.AdamW(router.parameters(), lr=1e-3)
    tc = TrainConfig(local_window=64)
    phases: dict[str, float] = {}
    wall, total = 0.0, 0.0
    losses: list[float] = []
    for i in range(a.steps + 1):
        ids = seqs[i * a.batch_size : (i + 1) * a.batch_size].to(dev)
        T = ids.shape[1]
        split = math.floor(tc.split * T)
        c0 = clock()
        w0 = time.perf_counter()
        marks = [c0]

        def mark() -> None:
            marks.append(clock())

        record = TeacherRecord(split)
        with torch.no_grad(), teacher_recording(model, record):
            teacher = model(ids, use_cache=False).logits.float()
        mark()
        h = surprisal_from_logits(teacher, ids)
        segs = _segment(router, model, h, split)
        mark()
        state = prepare_training(router, record, segs, h[:, :split], tc.local_window)
        mark()
        pos = torch.arange(split, T, device=dev).expand(ids.shape[0], -1)
        with sekv_training(model, state):
            student = model(ids[:, split:], position_ids=pos, use_cache=False).logits.float()
        logp_t = torch.log_softmax(teacher[:, split:], -1)
        kl = (logp_t.exp() * (logp_t - torch.log_softmax(student, -1))).sum(-1).mean()
        rec = state.records
        if not rec["zoom"]:
            raise SystemExit(f"no span at --seq-len {a.seq_len} with this config: nothing to train (use >= 256)")
        loss = (
            kl
            + torch.stack(rec["zoom"]).mean()
            + torch.stack(rec["recon"]).sum() / torch.stack(rec["recon_norm"]).sum()
        )
        mark()
        opt.zero_grad()
        loss.backward()
        mark()
        opt.step()
        mark()
        if i == 0:
            continue  # warm-up
        losses.append(float(loss.detach()))
        wall += time.perf_counter() - w0
        total += marks[-1] - marks[0]
        names = (
            "teacher pass",
            "surprisal + segmentation",
            "span preparation",
            "student pass + KL",
            "backward",
            "AdamW",
        )
        for name, x, y in zip(names, marks, marks[1:]):
            phases[name] = phases.get(name, 0.0) + y - x
    n = a.steps
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{platform.machine()} CPU"
    print(f"# {model_id}, {where}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"# seq {a.seq_len}, batch {a.batch_size}, {n} steps: {total / n:.2f} {unit}, {wall / n:.2f} s wall / step")
    print(f"# losses of the counted steps: {' '.join(f'{x:.4f}' for x in losses)}")
    print(f"| phase | {unit} / step | share |")
    print("|---|---|---|")
    for name, v in phases.items():
        print(f"| {name} | {v / n:.3f} | {100 * v / total:.0f} % |")


if __name__ == "__main__":
    main()
