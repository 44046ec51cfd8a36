"""The router's training loop (SEKV §3.4, Eqs. 10–15; optimisation of §4.1).

``L = L_distill + λ1 L_zoom + λ2 L_recon + λ3 L_budget`` (Eq. 10), each term a mean (our normalisation: the
paper's sums need it for its λ values): the KL of the frozen backbone with full KV (teacher) to the same backbone
with SEKV attention over the compressed prefix (student) at every continuation position (Eq. 11); the weighted BCE
of the gates against the ρ-coverage targets at mined positions (Eqs. 12–13); the gated tail energy over the total
energy (Eq. 14); the zoom rate plus β times the mean gate (Eq. 15, value gates included), with λ3 annealed linearly
from 0 over the first half. AdamW (lr 1e-3, weight decay 0.01) with 10 % linear warm-up then cosine decay, early
stopping on the held-out loss (``TrainConfig.monitor``), resumable checkpoints, tqdm progress and a loss-curve PNG.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kv_sekv.router import SEKVRouter
from kv_sekv.segmentation import fit_segmentation
from kv_sekv.surprisal import surprisal_from_logits
from kvcore.checks import check_int

from .forward import prepare_training, sekv_training
from .teacher import TeacherRecord, teacher_recording

__all__ = ["TrainConfig", "calibrate_tau", "evaluate", "train_router"]


@dataclass(frozen=True)
class TrainConfig:
    """Training settings (paper §4.1 where it gives them; the small-recipe values are ours).

    Parameters
    ----------
    steps : int
        Optimisation steps (the paper: ≈3K on 8×A100; the small recipe: a few hundred).
    batch_size : int
        Sequences per step (paper: 8).
    lr, weight_decay, warmup : float
        AdamW learning rate and weight decay, warm-up fraction of the cosine schedule (1e-3, 0.01, 0.1).
    split : float
        The prefix ``[0, c)``, ``c = floor(split · T)``, is compressed; the continuation is scored.
    local_window : int
        Mining window of the zoom loss (the paper: 512; ≈128 for short sequences).
    eval_every, patience : int
        Held-out evaluation period (steps) and the number of evaluations without improvement before stopping.
    monitor : {"total", "distill"}
        The held-out term early stopping and the kept parameters follow (our choice, the paper does not say):
        ``"total"``, Eq. 10 with the full λ3, by default; ``"distill"``, the KL alone, rewards zooming into every span,
        which the budget term exists to counter, so it stops as soon as λ3's annealing starts to bite.
    seed : int
        Batch order (a function of the seed and the step, so a resumed run sees the same batches).
    """

    steps: int = 300
    batch_size: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: float = 0.1
    split: float = 0.5
    local_window: int = 128
    eval_every: int = 25
    patience: int = 4
    monitor: str = "total"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "patience"):
            v = getattr(self, name)
            check_int(name, v, low=1)
        if self.monitor not in ("total", "distill"):
            raise ValueError(f"monitor must be 'total' or 'distill', got {self.monitor!r}")
        if not 0.0 < self.split < 1.0:
            raise ValueError(f"split must lie in (0, 1), got {self.split}")
        if not (self.lr > 0 and self.weight_decay >= 0 and 0 <= self.warmup < 1 and self.local_window >= 0):
            raise ValueError("lr must be > 0, weight_decay >= 0, warmup in [0, 1), local_window >= 0")


def _shapes(model: Any) -> tuple[int, int]:
    c = model.config
    heads = c.num_attention_heads
    return getattr(c, "num_key_value_heads", heads) or heads, getattr(c, "head_dim", None) or c.hidden_size // heads


def model_device(model: Any) -> torch.device:
    """The device of the backbone's parameters (where training and evaluation run)."""
    return next(model.parameters()).device


def _segment(router: SEKVRouter, model: Any, h: torch.Tensor, c: int) -> list:
    Hkv, D = _shapes(model)
    cfg = router.config
    cost = router.summary_cost(Hkv, D)
    return [
        fit_segmentation(
            h[b, :c],
            alpha=cfg.alpha,
            min_span=cfg.min_span,
            window=cfg.window,
            capacity=math.floor(cfg.budget * c),
            summary_cost=cost,
            window_share=cfg.window_share,
            zoom_share=cfg.zoom_share,
            max_span=cfg.max_span,
        )
        for b in range(h.shape[0])
    ]


def losses(
    model: Any,
    router: SEKVRouter,
    ids: torch.Tensor,
    tc: TrainConfig,
    lambda_budget: float,
    zoom_rate: dict[int, list[torch.Tensor]] | None = None,
    gates: dict[int, list[torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """The loss terms of Eq. 10 for a batch ``ids`` ``[B, T]`` (``"total"`` included); the per-layer zoom rates are
    added to ``zoom_rate`` when given, the gate values to ``gates`` (per layer, ``[Hq, pairs]``) when given.

    One teacher pass over the whole sequence without grad (full KV: the teacher logits, the prefix surprisal, the
    prefix keys and values, the zoom targets), then one student pass over the continuation ``[c, T)`` only, with the
    router in the graph (:mod:`kv_lab.sekv.forward`). ``ids`` may live anywhere (they are copied to the model's
    device); the router must be on the model's device (``ValueError`` otherwise).
    """
    device = model_device(model)
    if router.W.device != device:
        raise ValueError(
            f"router is on {router.W.device} and the model on {device}: move the router first (router.to(device))"
        )
    ids = ids.to(device)
    T = ids.shape[1]
    c = max(1, math.floor(tc.split * T))
    if c >= T:
        raise ValueError(f"the split leaves no continuation: T={T}, c={c}")
    record = TeacherRecord(c)
    with torch.no_grad(), teacher_recording(model, record):
        teacher = model(ids, use_cache=False).logits.float()
    h = surprisal_from_logits(teacher, ids)
    state = prepare_training(router, record, _segment(router, model, h, c), h[:, :c], tc.local_window)
    state.gates = gates
    del record
    pos = torch.arange(c, T, device=ids.device).expand(ids.shape[0], -1)
    with sekv_training(model, state):
        student = model(ids[:, c:], position_ids=pos, use_cache=False).logits.float()
    logp_t = torch.log_softmax(teacher[:, c:], -1)
    kl = (logp_t.exp() * (logp_t - torch.log_softmax(student, -1))).sum(-1).mean()
    rec = state.records
    if zoom_rate is not None:
        for layer, rates in state.zoom_rate.items():
            zoom_rate.setdefault(layer, []).extend(rates)
    zero = kl.new_zeros(())
    zoom = torch.stack(rec["zoom"]).mean() if rec["zoom"] else zero
    recon = (
        torch.stack(rec["recon"]).sum() / torch.stack(rec["recon_norm"]).sum().clamp_min(1e-12)
        if rec["recon"]
        else zero
    )
    budget = (torch.stack(rec["z"]).mean() if rec["z"] else zero) + router.config.beta * (
        torch.stack(rec["m"]).mean() if rec["m"] else zero
    )
    cfg = router.config
    total = kl + cfg.lambda_zoom * zoom + cfg.lambda_recon * recon + lambda_budget * budget
    return {"total": total, "distill": kl, "zoom": zoom, "recon": recon, "budget": budget}


@torch.no_grad()
def evaluate(
    model: Any, router: SEKVRouter, seqs: torch.Tensor, tc: TrainConfig, zoom_rate: dict | None = None
) -> dict[str, float]:
    """Mean loss terms over ``seqs`` (one sequence at a time); ``distill`` is the held-out KL. ``zoom_rate``, when
    given, receives ``{layer: [Hq] mean zoom rate}`` (SEKV Fig. 5)."""
    sums: dict[str, float] = {}
    rates: dict[int, list[torch.Tensor]] = {}
    for i in range(seqs.shape[0]):
        for k, v in losses(model, router, seqs[i : i + 1], tc, router.config.lambda_budget, rates).items():
            sums[k] = sums.get(k, 0.0) + float(v)
    if zoom_rate is not None:
        zoom_rate.update({layer: torch.stack(r).mean(0) for layer, r in sorted(rates.items())})
    return {k: v / seqs.shape[0] for k, v in sums.items()}


@torch.no_grad()
def calibrate_tau(model: Any, router: SEKVRouter, seqs: torch.Tensor, tc: TrainConfig, rate: float) -> torch.Tensor:
    """Set every threshold ``τ^{(l,h)}`` so that the gate opens on a fraction ``rate`` of the (query, span) pairs of
    ``seqs`` (one sequence at a time, as in training): ``τ = quantile(α̃, 1 − rate)`` per layer and query head.

    Our addition (the paper learns τ through the straight-through budget term, Eq. 15). With the few hundred CPU
    steps of the small recipe τ moves by at most ``lr`` per step (AdamW normalises the gradient), far too little to
    reach the operating point of a 10 % budget, so the trained gate's *order* is kept and its operating point set to
    the zoom share the budget allows. Returns the new ``τ`` ``[L, Hq]`` (also written into ``router.tau``).
    """
    if not 0.0 < rate < 1.0:
        raise ValueError(f"rate must lie in (0, 1), got {rate}")
    gates: dict[int, list[torch.Tensor]] = {}
    for i in range(seqs.shape[0]):
        losses(model, router, seqs[i : i + 1], tc, router.config.lambda_budget, gates=gates)
    tau = router.tau.detach().clone()
    for layer, parts in gates.items():
        g = torch.cat(parts, 1).float()
        if g.shape[1]:
            tau[layer] = torch.quantile(g, 1.0 - rate, dim=1).clamp(0.0, 1.0 - 1e-6).to(tau.dtype)
    router.tau.data.copy_(tau)
    return tau


def _schedule(tc: TrainConfig):
    warm = max(1, round(tc.warmup * tc.steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, tc.steps - warm))))

    return factor


def train_router(
    model: Any,
    router: SEKVRouter,
    train: torch.Tensor,
    held_out: torch.Tensor,
    tc: TrainConfig | None = None,
    out_dir: str | Path | None = None,
    *,
    resume: bool = True,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train ``router`` in place on ``train`` ``[N, T]`` token sequences with ``model`` frozen.

    Training runs on the model's device (a GPU when the model is on one): the router is moved there, the batches are
    copied there from ``train`` / ``held_out`` (which may stay on the CPU), and a checkpoint written on one device
    resumes on another.

    Parameters
    ----------
    model : transformers causal LM
        The frozen backbone (Llama-style attention modules with ``layer_idx``).
    router : SEKVRouter
        Trained in place (and moved to the model's device); at the end it holds the parameters of the best held-out
        ``tc.monitor`` term.
    train, held_out : Tensor
        Token sequences.
    tc : TrainConfig
        Settings.
    out_dir : path, optional
        Checkpoints (``checkpoint.pt``, written at every evaluation and at the end) and ``loss_curve.png``.
    resume : bool
        Continue from ``out_dir/checkpoint.pt`` when it exists (same batches, schedule and optimiser state).
    progress : bool
        tqdm progress bar (when tqdm is installed).
    stop_after : int, optional
        Stop (with a checkpoint) after this many steps of this call, as if interrupted.

    Returns
    -------
    dict
        ``history`` (per-step loss terms), ``evals`` (step, held-out terms), ``best_step``, ``stopped_early``.
    """
    tc = TrainConfig() if tc is None else tc
    model.requires_grad_(False)
    model.eval()
    router.to(model_device(model))
    opt = torch.optim.AdamW(router.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(tc))
    state: dict[str, Any] = {
        "step": 0,
        "history": [],
        "evals": [],
        "best": math.inf,
        "best_step": 0,
        "bad": 0,
        "best_state": None,
        "stopped_early": False,
    }
    ckpt = None if out_dir is None else Path(out_dir) / "checkpoint.pt"
    if ckpt is not None and resume and ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False, map_location="cpu")  # load_state_dict moves to the router
        if saved["train_config"] != asdict(tc):
            raise ValueError(f"{ckpt} was written with other training settings: {saved['train_config']}")
        router.load_state_dict(saved["router"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        state = saved["state"]

    def save() -> None:
        if ckpt is None:
            return
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "router": router.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "state": state,
                "train_config": asdict(tc),
            },
            ckpt,
        )

    bar = _bar(tc.steps, state["step"], progress)
    done_here = 0
    while state["step"] < tc.steps and not state["stopped_early"]:
        step = state["step"]
        g = torch.Generator().manual_seed(tc.seed * 1_000_003 + step)
        rows = torch.randint(0, train.shape[0], (tc.batch_size,), generator=g)
        lam3 = router.config.lambda_budget * min(1.0, step / max(1.0, 0.5 * tc.steps))  # annealed from 0
        terms = losses(model, router, train[rows], tc, lam3)
        opt.zero_grad(set_to_none=True)
        terms["total"].backward()
        opt.step()
        sched.step()
        state["history"].append({k: float(v.detach()) for k, v in terms.items()})
        state["step"] = step + 1
        done_here += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{float(terms['total'].detach()):.4f}", kl=f"{float(terms['distill'].detach()):.4f}")
        if state["step"] % tc.eval_every == 0 or state["step"] == tc.steps:
            ev = evaluate(model, router, held_out, tc)
            state["evals"].append({"step": state["step"], **ev})
            if ev[tc.monitor] < state["best"]:
                state["best"], state["best_step"], state["bad"] = ev[tc.monitor], state["step"], 0
                state["best_state"] = {k: v.detach().clone() for k, v in router.state_dict().items()}
            else:
                state["bad"] += 1
                state["stopped_early"] = state["bad"] >= tc.patience
            save()
        if stop_after is not None and done_here >= stop_after:
            save()
            break
    if bar is not None:
        bar.close()
    finished = state["step"] >= tc.steps or state["stopped_early"]
    if finished and state["best_state"] is not None:
        router.load_state_dict(state["best_state"])
    if out_dir is not None:
        save()
        plot_losses(state, Path(out_dir) / "loss_curve.png")
    return {k: state[k] for k in ("history", "evals", "best_step", "stopped_early", "step")}


def _bar(total: int, initial: int, progress: bool):
    if not progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc="kv-sekv train", unit="step")


def plot_losses(state: dict[str, Any], path: Path) -> Path | None:
    """Training terms per step and the held-out KL and total per evaluation, as a PNG (``None`` without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(state["history"]) + 1)
    for key in ("total", "distill", "zoom", "recon", "budget"):
        ax.plot(steps, [h[key] for h in state["history"]], label=f"train {key}", lw=1)
    if state["evals"]:
        steps_ev = [e["step"] for e in state["evals"]]
        ax.plot(steps_ev, [e["distill"] for e in state["evals"]], "ko-", ms=3, label="held-out KL")
        ax.plot(steps_ev, [e["total"] for e in state["evals"]], "ks--", ms=3, label="held-out total")
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("SEKV router training (Eq. 10)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
