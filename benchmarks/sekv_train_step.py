"""CPU cost of one SEKV router training step on SmolLM2-135M, by phase (SEKV §3.4, ``kv_sekv.train``).

A step is: the teacher pass (full KV, no grad; records the prefix keys/values and the continuation queries), the
prefix surprisal and segmentation, the span preparation for every layer at once (coarse entries, span SVDs, gates
``g_φ``, reconstructions, the teacher's zoom targets), the student pass over the continuation, the backward and the
AdamW step. CPU time is the process's user + system time (``resource.getrusage``), so it counts every thread.

Run: ``uv run python benchmarks/sekv_train_step.py --steps 6 --threads 1`` (needs kvbench's offline SmolLM2 and
gensim's lee_background corpus). The first step is a warm-up and is not counted.
"""

from __future__ import annotations

import argparse
import math
import platform
import resource
import time

import torch

from kv_sekv import SEKVConfig, SEKVRouter
from kv_sekv.cli import load_model, read_corpus
from kv_sekv.surprisal import surprisal_from_logits
from kv_sekv.train import (
    TeacherRecord,
    TrainConfig,
    corpus_sequences,
    prepare_training,
    sekv_training,
    teacher_recording,
)
from kv_sekv.train.loop import _segment


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, tok, model_id = load_model("smollm2")
    model.requires_grad_(False)
    seqs = corpus_sequences(read_corpus(None), tok, a.seq_len)
    c = model.config
    cfg = SEKVConfig(window=64, budget=0.2)
    router = SEKVRouter.untrained(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, cfg)
    opt = torch.optim.AdamW(router.parameters(), lr=1e-3)
    tc = TrainConfig(local_window=64)
    phases: dict[str, float] = {}
    wall, total = 0.0, 0.0
    for i in range(a.steps + 1):
        ids = seqs[i * a.batch_size : (i + 1) * a.batch_size]
        T = ids.shape[1]
        split = math.floor(tc.split * T)
        w0, c0 = time.perf_counter(), cpu_s()
        marks = [c0]

        def mark() -> None:
            marks.append(cpu_s())

        record = TeacherRecord(split)
        with torch.no_grad(), teacher_recording(model, record):
            teacher = model(ids, use_cache=False).logits.float()
        mark()
        h = surprisal_from_logits(teacher, ids)
        segs = _segment(router, model, h, split)
        mark()
        state = prepare_training(router, record, segs, h[:, :split], tc.local_window)
        mark()
        pos = torch.arange(split, T).expand(ids.shape[0], -1)
        with sekv_training(model, state):
            student = model(ids[:, split:], position_ids=pos, use_cache=False).logits.float()
        logp_t = torch.log_softmax(teacher[:, split:], -1)
        kl = (logp_t.exp() * (logp_t - torch.log_softmax(student, -1))).sum(-1).mean()
        rec = state.records
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
    print(f"# {model_id}, {platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(
        f"# seq-len {a.seq_len}, batch {a.batch_size}, {n} steps: {total / n:.2f} CPU-s, {wall / n:.2f} s wall per step"
    )
    print("| phase | CPU-s / step | share |")
    print("|---|---|---|")
    for name, v in phases.items():
        print(f"| {name} | {v / n:.3f} | {100 * v / total:.0f} % |")


if __name__ == "__main__":
    main()
