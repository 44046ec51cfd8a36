"""FastKVzip: a trained sink-attention gate that predicts KVzip's scores without the reconstruction pass.

Based on Fast KVzip (Kim, Han and Yun 2026, "Fast KVzip: Efficient and Accurate LLM Inference with Gated KV
Eviction", arXiv:2601.17668; Janghyun1230/FastKVzip ``optim.py`` / ``prefill/attention/gate.py``), the base scorer of
the HubKV paper's main and decoding-stage experiments (HubKV §4, Appendix A: "FastKVZip (Kim et al., 2026a)
predicts KV utility with a hardware-friendly gating unit"). Per layer and KV head, each token gets a gate query
``q`` (``groups`` of ``dim`` channels, RMS-normed, with bias) and a gate key ``k`` (``dim``, RMS-normed) from a
linear map of its features, and competes with ``sinks`` learned sink keys::

    score = 1 / (1 + sum_s exp(k_s . q / sqrt(dim) - (k . q / sqrt(dim) + b)))      averaged over the groups

a value in (0, 1) regressed (binary cross-entropy) on KVzip's scores, themselves in [0, 1]. Defaults are the
authors' ``q{group}_dim16_sink16`` gate (``dim`` 16, 16 sinks, ``groups`` = the model's GQA group size).

Departure (documented in docs/methods/hubkv.md): the authors' gate reads the hidden state entering the attention
layer; this one reads what every ``kvcore`` scorer gets, the entry's own post-RoPE key and value: the value and the
norm of each RoPE pair of the key (both unchanged by the rotation, so the gate does not see the position), RMS-normed
per token. The scorer then needs no extra from the engine, and the same gate re-scores the held entries when the
cache is re-compressed while decoding (HubKV §4.3), where the hidden states of old entries are gone.

The gate shipped for SmolLM2-135M (``kv_baselines/gates/smollm2-135m.pt`` with its JSON sidecar: shapes, config,
training record, SHA-256) is trained by ``kv-fastkvzip train`` (tools/kv-lab).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvcore import Scorer, Scores, ScoringContext
from kvcore.artifacts import read_sidecar, write_sidecar
from kvcore.checks import check_int
from kvcore.replan import HEAD_EXTRA

__all__ = [
    "FastKVzipConfig",
    "FastKVzipGate",
    "FastKVzipScorer",
    "ShippedGate",
    "UntrainedGates",
    "gate_features",
    "gate_reference",
]

FORMAT_VERSION = 1
GATES_DIR = Path(__file__).resolve().parent.parent / "gates"


@dataclass(frozen=True, kw_only=True)
class FastKVzipConfig:
    """Shape of the gate (defaults: the authors' ``q{group}_dim16_sink16`` gate, Fast KVzip §3).

    Parameters
    ----------
    dim : int, default 16
        Channels of the gate's query and key per KV head.
    sinks : int, default 16
        Learned sink keys the token's own logit competes with (0: a plain sigmoid of the logit).
    groups : int, default 1
        Gate queries per KV head (the authors use the GQA group size; :meth:`FastKVzipGate.untrained` fills it from
        the model when built for one).
    eps : float, default 1e-6
        RMS-norm epsilon.
    """

    dim: int = 16
    sinks: int = 16
    groups: int = 1
    eps: float = 1e-6

    def __post_init__(self) -> None:
        check_int("dim", self.dim, low=1)
        check_int("sinks", self.sinks, low=0)
        check_int("groups", self.groups, low=1)
        if not (isinstance(self.eps, float) and 0.0 < self.eps < 1.0):
            raise ValueError(f"eps must be a float in (0, 1), got {self.eps!r}")


def gate_features(keys: torch.Tensor, values: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``[..., T, D + D/2]`` float32 gate inputs: the values and the norm of each RoPE pair of the keys (rotate-half
    layout: channels ``i`` and ``i + D/2``), the whole vector RMS-normalised per token."""
    if keys.shape != values.shape or keys.shape[-1] % 2:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must match with an even head dim")
    k = keys.float()
    half = k.shape[-1] // 2
    pair = torch.sqrt(k[..., :half] ** 2 + k[..., half:] ** 2)
    x = torch.cat([values.float(), pair], -1)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class FastKVzipGate(nn.Module):
    """Per-layer, per-KV-head sink-attention gates (see the module notes for the formula).

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        The model's shapes (one gate per layer and KV head; inputs of ``head_dim * 3 / 2`` features).
    config : FastKVzipConfig
    model_id : str
        The model the gate was trained for (checked when loading).
    record : dict
        Free-form training record kept in the sidecar (data, steps, held-out metrics).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        config: FastKVzipConfig | None = None,
        model_id: str = "",
        record: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        check_int("num_layers", num_layers, low=1)
        check_int("num_kv_heads", num_kv_heads, low=1)
        check_int("head_dim", head_dim, low=2)
        if head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE pairs), got {head_dim}")
        self.config = config or FastKVzipConfig()
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.model_id, self.record = model_id, dict(record or {})
        c, L, H, F = self.config, num_layers, num_kv_heads, head_dim * 3 // 2
        self.q_weight = nn.Parameter(torch.randn(L, H, F, c.groups * c.dim) / math.sqrt(F))
        self.q_bias = nn.Parameter(torch.zeros(L, H, c.groups * c.dim))
        self.k_weight = nn.Parameter(torch.randn(L, H, F, c.dim) / math.sqrt(F))
        self.q_norm = nn.Parameter(torch.ones(L, c.dim))
        self.k_norm = nn.Parameter(torch.ones(L, c.dim))
        self.sink_keys = nn.Parameter(torch.zeros(L, H, max(c.sinks, 1), c.dim))
        self.bias = nn.Parameter(torch.zeros(L, H, c.groups))

    @classmethod
    def untrained(cls, num_layers: int, num_kv_heads: int, head_dim: int, groups: int = 1, seed: int = 0, **kw):
        """A gate with the seeded initialisation (tests, the start of training)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(num_layers, num_kv_heads, head_dim, FastKVzipConfig(groups=groups, **kw))

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.config.eps) * w

    def logits(self, layer: int | slice, x: torch.Tensor, head: int | None = None) -> torch.Tensor:
        """``[B, H, T, G]`` pre-sigmoid gate logits of features ``x [B, H, T, F]`` at ``layer`` (the score is
        ``mean_G sigmoid(logit)``). With ``layer=slice(None)``, ``x`` is ``[L, H, T, F]`` and its first axis is the
        layer (training fits every layer in one pass)."""
        c = self.config
        one = not isinstance(layer, slice)
        p = [t[layer] for t in (self.q_weight, self.q_bias, self.k_weight, self.q_norm, self.k_norm)]
        p += [self.sink_keys[layer], self.bias[layer]]
        if head is not None:  # one KV head's gate (x holds that head alone): per-head re-planning scores head by head
            p = [t if i in (3, 4) else t[head : head + 1] for i, t in enumerate(p)]
        if one:
            p = [t.unsqueeze(0) for t in p]
        qw, qb, kw, qn, kn, sk, b = p  # leading axis: 1 (broadcast over the batch) or the layers
        q = torch.einsum("bhtf,bhfe->bhte", x, qw.expand(x.shape[0], *qw.shape[1:])) + qb[:, :, None]
        q = self._rms(q.unflatten(-1, (c.groups, c.dim)), qn[:, None, None, None])  # [B, H, T, G, d]
        k = self._rms(torch.einsum("bhtf,bhfd->bhtd", x, kw.expand(x.shape[0], *kw.shape[1:])), kn[:, None, None])
        own = torch.einsum("bhtd,bhtgd->bhtg", k, q) / math.sqrt(c.dim) + b[:, :, None]
        if not c.sinks:
            return own
        base = torch.einsum("bhsd,bhtgd->bhtgs", sk.expand(x.shape[0], *sk.shape[1:]), q) / math.sqrt(c.dim)
        return own - torch.logsumexp(base, -1)  # 1 / (1 + sum_s exp(base_s - own)) = sigmoid(own - lse(base))

    def forward(self, layer: int, keys: torch.Tensor, values: torch.Tensor, head: int | None = None) -> torch.Tensor:
        """``[B, H, T]`` float32 gate scores in (0, 1) of post-RoPE ``keys`` / ``values [B, H, T, D]``; with ``head``,
        ``keys`` hold that KV head alone (``H = 1``) and its gate is used."""
        self.check(layer, keys, head)
        x = gate_features(keys, values, self.config.eps).to(self.q_weight.device)
        return torch.sigmoid(self.logits(layer, x, head)).mean(-1)

    def check(self, layer: int, keys: torch.Tensor, head: int | None = None) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"the FastKVzip gate has {self.num_layers} layers, got layer_idx={layer}")
        if head is not None and not (isinstance(head, int) and 0 <= head < self.num_kv_heads and keys.shape[1] == 1):
            raise ValueError(f"head must index one of the gate's {self.num_kv_heads} KV heads with keys of one head")
        heads = 1 if head is not None else self.num_kv_heads
        if keys.shape[1] != heads or keys.shape[-1] != self.head_dim:
            raise ValueError(
                f"the FastKVzip gate{' for ' + self.model_id if self.model_id else ''} takes {self.num_kv_heads} KV "
                f"heads of dim {self.head_dim}, got keys {tuple(keys.shape)}: train one for this model with "
                "`kv-fastkvzip train`"
            )

    # -- artifact ----------------------------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "model_id": self.model_id,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "config": asdict(self.config),
            "shapes": {k: list(v.shape) for k, v in self.state_dict().items()},
            "record": self.record,
        }

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (a ``torch.save`` of the tensors) and its JSON sidecar (``.json``, with the SHA-256)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, path)
        return write_sidecar(path, self.metadata())

    @classmethod
    def load(cls, path: str | Path, model_id: str | None = None) -> FastKVzipGate:
        """Load a gate written by :meth:`save`, checking the checksum, the shapes and (if given) the model.

        Raises ``FileNotFoundError`` (a file missing) or ``ValueError`` (checksum, version, shapes or model).
        """
        path = Path(path)
        meta = read_sidecar(
            path, what="FastKVzip gate", writer="FastKVzipGate.save", format_version=FORMAT_VERSION, model_id=model_id
        )
        gate = cls(
            meta["num_layers"],
            meta["num_kv_heads"],
            meta["head_dim"],
            FastKVzipConfig(**meta["config"]),
            meta["model_id"],
            meta.get("record"),
        )
        tensors = torch.load(path, map_location="cpu", weights_only=True)
        want = {k: list(v.shape) for k, v in gate.state_dict().items()}
        got = {k: list(v.shape) for k, v in tensors.items()}
        if got != want or meta.get("shapes") != want:
            raise ValueError(
                f"{path}: tensor shapes {got} do not match the gate described in its sidecar "
                f"{path.with_suffix('.json').name} ({want})"
            )
        gate.load_state_dict(tensors)
        return gate.eval().requires_grad_(False)


class ShippedGate:
    """The gate shipped with kv-baselines for a model (``kv_baselines/gates/<name>.pt``), loaded when first used."""

    def __init__(self, name: str = "smollm2-135m") -> None:
        self.name = name
        self._gate: FastKVzipGate | None = None

    def path(self) -> Path:
        return GATES_DIR / f"{self.name}.pt"

    def resolve(self, num_kv_heads: int, head_dim: int, layer_idx: int, head: int | None = None) -> FastKVzipGate:
        if self._gate is None:
            if not self.path().is_file():
                raise ValueError(
                    f"kv-baselines ships no FastKVzip gate named {self.name!r}: train one with `kv-fastkvzip train` "
                    "and pass FastKVzipScorer(gate=FastKVzipGate.load(path))"
                )
            self._gate = FastKVzipGate.load(self.path())
        return self._gate

    def __repr__(self) -> str:
        return f"ShippedGate({self.name!r})"

    def __eq__(self, other: object) -> bool:
        """Two handles on the same shipped file are the same gate (the loaded copy is a cache)."""
        return isinstance(other, ShippedGate) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("ShippedGate", self.name))


@dataclass
class UntrainedGates:
    """Seeded untrained gates built for whatever shapes they meet (tests; the untrained-gate ablation)."""

    seed: int = 0
    layers: int = 64
    _made: dict = field(default_factory=dict, repr=False, compare=False)

    def resolve(self, num_kv_heads: int, head_dim: int, layer_idx: int, head: int | None = None) -> FastKVzipGate:
        key = (max(num_kv_heads, (head or 0) + 1), head_dim)
        if key not in self._made:
            self._made[key] = FastKVzipGate.untrained(self.layers, num_kv_heads, head_dim, seed=self.seed).eval()
        return self._made[key]

    def __hash__(self) -> int:
        return hash((self.seed, self.layers))


@dataclass(frozen=True)
class FastKVzipScorer(Scorer):
    """Scores = the FastKVzip gate of the layer's held keys and values (``[B, Hkv, T]`` in (0, 1); higher = keep).

    Parameters
    ----------
    gate : FastKVzipGate or a source with ``resolve(num_kv_heads, head_dim, layer_idx)``
        Default: the gate shipped for SmolLM2-135M (:class:`ShippedGate`).
    """

    gate: Any = field(default_factory=ShippedGate)

    def _gate(self, ctx: ScoringContext) -> FastKVzipGate:
        g = self.gate
        if not isinstance(g, FastKVzipGate):
            if not callable(getattr(g, "resolve", None)):
                raise TypeError(f"gate must be a FastKVzipGate or have resolve(...), got {type(g).__name__}")
            g = g.resolve(ctx.num_kv_heads, ctx.keys.shape[-1], ctx.layer_idx, ctx.extras.get(HEAD_EXTRA))
        return g

    def score(self, ctx: ScoringContext) -> Scores:
        gate = self._gate(ctx)
        head = ctx.extras.get(HEAD_EXTRA)  # a per-head re-plan of a ragged cache scores one KV head at a time
        with torch.no_grad():
            s = gate(ctx.layer_idx, ctx.keys, ctx.values, head).to(ctx.keys.device)
        return Scores(torch.nan_to_num(s, nan=0.0))


@torch.no_grad()
def gate_reference(gate: FastKVzipGate, layer: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The gate's scores computed token by token and head by head with plain loops (the test reference)."""
    c = gate.config
    B, H, T, D = keys.shape
    out = torch.zeros(B, H, T)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                k, v = keys[b, h, t].double(), values[b, h, t].double()
                pair = [math.hypot(float(k[i]), float(k[i + D // 2])) for i in range(D // 2)]
                x = torch.cat([v, torch.tensor(pair, dtype=torch.float64)])
                x = x / math.sqrt(float(x.square().mean()) + c.eps)
                qv = x @ gate.q_weight[layer, h].double() + gate.q_bias[layer, h].double()
                kv = x @ gate.k_weight[layer, h].double()
                kv = kv / math.sqrt(float(kv.square().mean()) + c.eps) * gate.k_norm[layer].double()
                total = 0.0
                for g in range(c.groups):
                    q = qv[g * c.dim : (g + 1) * c.dim]
                    q = q / math.sqrt(float(q.square().mean()) + c.eps) * gate.q_norm[layer].double()
                    own = float(kv @ q) / math.sqrt(c.dim) + float(gate.bias[layer, h, g])
                    if c.sinks:
                        denom = 1.0 + sum(
                            math.exp(float(gate.sink_keys[layer, h, s].double() @ q) / math.sqrt(c.dim) - own)
                            for s in range(c.sinks)
                        )
                        total += 1.0 / denom
                    else:
                        total += 1.0 / (1.0 + math.exp(-own))
                out[b, h, t] = total / c.groups
    return out
