"""The SEKV router: routing projections ``W``, zoom thresholds ``τ`` and the gate network ``g_φ`` (SEKV §3.2–3.4).

Trainable parameters with the backbone frozen (§3.4): ``W ∈ R^{L×H×d′×d_h}`` (Eqs. 3–4), ``τ ∈ R^{L×H}`` (Eq. 9)
and a shared gate network ``g_φ`` (Eq. 7). The paper does not describe ``g_φ`` beyond "< 0.1M parameters"; ours
(a choice) is an MLP ``in → 128 → ReLU → 128 → ReLU → R_max`` whose input is ``σ_{1..R_max}/σ_1`` (zero padded),
``log σ_1``, the component mask, the span's routing summary (group mean over the query heads, detached) and a
key/value flag.

An artifact is a safetensors file of the tensors plus a JSON sidecar (same stem, ``.json``) with the shapes, the
settings, the model identity and the SHA-256 of the tensor file; :meth:`SEKVRouter.load` checks all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from kvcore.artifacts import read_sidecar, write_sidecar
from kvcore.checks import check_int

from .config import SEKVConfig

__all__ = ["FORMAT_VERSION", "ROUTERS_DIR", "GateNet", "RouterSource", "SEKVRouter", "ShippedRouter", "shipped_routers"]

FORMAT_VERSION = 1
"""Version of the artifact's JSON layout."""


@runtime_checkable
class RouterSource(Protocol):
    """Anything that gives a router when it is first needed (a router gives itself).

    ``resolve`` is called with the shapes of the cache being compressed (``num_kv_heads``, ``head_dim`` of the
    layer), so a source may choose the router by model (:class:`ShippedRouter` does); ``None`` when unknown.
    """

    def resolve(self, num_kv_heads: int | None = None, head_dim: int | None = None) -> SEKVRouter: ...


class GateNet(nn.Module):
    """``g_φ``: per-component gate logits of a span's keys or values (Eq. 7)."""

    def __init__(self, max_rank: int, proj_dim: int, hidden: int = 128) -> None:
        super().__init__()
        self.max_rank, self.proj_dim = max_rank, proj_dim
        self.net = nn.Sequential(
            nn.Linear(2 * max_rank + 2 + proj_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, max_rank),
        )

    def features(self, sigma: torch.Tensor, summary: torch.Tensor, is_value: bool) -> torch.Tensor:
        """Input of the net: ``σ`` ``[..., R]`` (``R <= R_max``, descending) and a summary ``[..., d′]``."""
        R = sigma.shape[-1]
        s = torch.nn.functional.pad(sigma.float(), (0, self.max_rank - R))
        s1 = s[..., :1].clamp_min(1e-30)
        mask = torch.nn.functional.pad(torch.ones_like(sigma, dtype=torch.float32), (0, self.max_rank - R))
        flag = torch.full_like(s1, float(is_value))
        return torch.cat([s / s1, torch.log(s1), mask, summary.float().detach(), flag], -1)

    def forward(self, sigma: torch.Tensor, summary: torch.Tensor, is_value: bool) -> torch.Tensor:
        """Gates ``m = sigmoid(g_φ(σ, K̄_S))`` ``[..., R]`` (Eq. 7)."""
        R = sigma.shape[-1]
        return torch.sigmoid(self.net(self.features(sigma, summary, is_value))[..., :R])


@dataclass(frozen=True)
class LayerRouting:
    """One layer's routing parameters: ``W`` ``[Hq, d′, D]`` and ``τ`` ``[Hq]`` (float32, detached)."""

    W: torch.Tensor
    tau: torch.Tensor


class SEKVRouter(nn.Module):
    """Routing projections, zoom thresholds and gate network of one backbone.

    Parameters
    ----------
    num_layers, num_heads, num_kv_heads, head_dim : int
        The backbone's shapes (``num_heads`` query heads, a multiple of ``num_kv_heads``).
    config : SEKVConfig
        ``d′``, ``R_max`` and ``τ`` init (and the settings recorded in the artifact).
    model_id : str
        Identity of the backbone (recorded and checked on load).
    """

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        config: SEKVConfig | None = None,
        model_id: str = "",
    ) -> None:
        super().__init__()
        config = SEKVConfig() if config is None else config
        if not isinstance(config, SEKVConfig):
            raise TypeError(f"config must be a kv_sekv.SEKVConfig, got {type(config).__name__}")
        for name, v in (
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            check_int(name, v, low=1)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if not isinstance(model_id, str):
            raise TypeError(f"model_id must be a str, got {type(model_id).__name__}")
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = (
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        self.config, self.model_id = config, model_id
        d = config.proj_dim
        self.W = nn.Parameter(torch.zeros(num_layers, num_heads, d, head_dim))
        self.tau = nn.Parameter(torch.full((num_layers, num_heads), config.tau_init))
        self.gate = GateNet(config.max_rank, d)
        self._on_device: dict[tuple[int, str], tuple[tuple[int, ...], LayerRouting]] = {}

    # -- construction ----------------------------------------------------------------------------------------
    @classmethod
    def untrained(
        cls,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        config: SEKVConfig | None = None,
        model_id: str = "untrained",
        seed: int = 0,
        gate_bias: float = 4.0,
    ) -> SEKVRouter:
        """A deterministic untrained router: semi-orthogonal rows of ``W`` (our init), ``τ = τ_init`` and a gate
        net whose output is the constant ``gate_bias`` (``sigmoid(4) ≈ 0.98``: every component kept; ``30`` gives
        gates of exactly 1 in float32). Same arguments, same router."""
        router = cls(num_layers, num_heads, num_kv_heads, head_dim, config, model_id)
        g = torch.Generator().manual_seed(seed)
        d = router.config.proj_dim
        with torch.no_grad():
            x = torch.randn(num_layers, num_heads, head_dim, d, generator=g)
            if d <= head_dim:
                q, _ = torch.linalg.qr(x)  # [.., D, d'] orthonormal columns
                router.W.copy_(q.transpose(-1, -2))
            else:
                router.W.copy_(x.transpose(-1, -2) / math.sqrt(head_dim))
            for m in router.gate.net:
                if isinstance(m, nn.Linear):
                    bound = 1.0 / math.sqrt(m.in_features)
                    m.weight.copy_((torch.rand(m.weight.shape, generator=g) * 2 - 1) * bound)
                    m.bias.copy_((torch.rand(m.bias.shape, generator=g) * 2 - 1) * bound)
            last = router.gate.net[-1]
            last.weight.zero_()
            last.bias.fill_(float(gate_bias))
        return router

    def resolve(self, num_kv_heads: int | None = None, head_dim: int | None = None) -> SEKVRouter:
        """This router, whatever the shapes (:meth:`check` refuses a layer it does not fit)."""
        return self

    # -- use ---------------------------------------------------------------------------------------------------
    def check(self, layer: int, num_kv_heads: int, head_dim: int) -> None:
        """``ValueError`` when this router does not fit a layer with these shapes (a router of another model)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside this router's {self.num_layers} layers ({self.describe()})")
        if num_kv_heads != self.num_kv_heads or head_dim != self.head_dim:
            raise ValueError(
                f"the router was trained for {self.num_kv_heads} KV heads of dim {self.head_dim} ({self.describe()}), "
                f"the cache has {num_kv_heads} KV heads of dim {head_dim}: train a router for this model "
                "(kv-sekv train)"
            )

    def check_config(self, config: Any) -> None:
        """``ValueError`` unless a backbone's config has this router's shapes (no weights are needed).

        Parameters
        ----------
        config : transformers config
            Any object with ``num_hidden_layers``, ``num_attention_heads``, ``hidden_size`` and, when they differ
            from the defaults, ``num_key_value_heads`` and ``head_dim`` (a ``transformers.PretrainedConfig``).

        Raises
        ------
        TypeError
            ``config`` lacks those fields.
        ValueError
            Another number of layers, query heads, KV heads or head dim; the message names both shapes.
        """
        try:
            layers, heads, hidden = config.num_hidden_layers, config.num_attention_heads, config.hidden_size
        except AttributeError as err:
            raise TypeError(
                "config must be a transformers model config (num_hidden_layers, num_attention_heads, hidden_size), "
                f"got {type(config).__name__}"
            ) from err
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        got = (layers, heads, kv, head_dim)
        if got != (self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"the router does not fit this model: it was trained for {self.describe()}; the model has "
                f"L={layers}, H={heads}, Hkv={kv}, d_h={head_dim}: train a router for this model (kv-sekv train)"
            )

    def describe(self) -> str:
        return (
            f"model {self.model_id!r}: L={self.num_layers}, H={self.num_heads}, Hkv={self.num_kv_heads}, "
            f"d_h={self.head_dim}, d'={self.config.proj_dim}, R_max={self.config.max_rank}"
        )

    def layer(self, layer: int, device: torch.device | str | None = None) -> LayerRouting:
        """Layer ``layer``'s ``W`` and ``τ``, detached float32; with ``device``, copies on that device kept from call
        to call (a decode step on a GPU with the router on the CPU would otherwise copy them, and wait for the GPU,
        in every layer), refreshed when the parameters change in place (training)."""
        if device is None or torch.device(device) == self.W.device:
            return LayerRouting(self.W[layer].detach().float(), self.tau[layer].detach().float())
        key = (layer, str(torch.device(device)))
        version = (self.W.data_ptr(), self.W._version, self.tau.data_ptr(), self.tau._version)
        held = self._on_device.get(key)
        if held is None or held[0] != version:
            here = self.layer(layer)
            held = (version, LayerRouting(here.W.to(device), here.tau.to(device)))
            self._on_device[key] = held
        return held[1]

    def summary_cost(self, num_kv_heads: int, head_dim: int) -> float:
        """Accelerator cost of one span's routing summaries in token equivalents per KV head: ``g·d′ / (2 d_h)``."""
        return (self.num_heads / num_kv_heads) * self.config.proj_dim / (2.0 * head_dim)

    @torch.no_grad()
    def gates(self, sigma: torch.Tensor, summary: torch.Tensor, is_value: bool) -> torch.Tensor:
        """Inference gates (Eq. 7) with the net on ``sigma``'s device."""
        self.gate.to(sigma.device)
        return self.gate(sigma, summary, is_value)

    # -- artifact ----------------------------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        c = self.config
        return {
            "format_version": FORMAT_VERSION,
            "model_id": self.model_id,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "config": {f: getattr(c, f) for f in c.__dataclass_fields__},
            "shapes": {k: list(v.shape) for k, v in self.state_dict().items()},
        }

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (safetensors) and its JSON sidecar ``path.with_suffix('.json')``; returns the JSON path."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(path))
        return write_sidecar(path, self.metadata())

    @classmethod
    def load(cls, path: str | Path, model_id: str | None = None) -> SEKVRouter:
        """Load an artifact written by :meth:`save`, checking its checksum, shapes and (if given) the model id.

        Raises
        ------
        FileNotFoundError
            The tensor file or its JSON sidecar is missing.
        ValueError
            Checksum mismatch, a tensor whose shape differs from the JSON, another format version, or another model.
        """
        from safetensors.torch import load_file

        path = Path(path)
        meta = read_sidecar(
            path, what="SEKV router", writer="SEKVRouter.save", format_version=FORMAT_VERSION, model_id=model_id
        )
        config = SEKVConfig(**meta["config"])
        router = cls(
            meta["num_layers"], meta["num_heads"], meta["num_kv_heads"], meta["head_dim"], config, meta["model_id"]
        )
        tensors = load_file(str(path))
        want = {k: list(v.shape) for k, v in router.state_dict().items()}
        got = {k: list(v.shape) for k, v in tensors.items()}
        if got != want or meta.get("shapes") != want:
            raise ValueError(
                f"{path}: tensor shapes {got} do not match the router described in its sidecar "
                f"{path.with_suffix('.json').name} ({want})"
            )
        router.load_state_dict(tensors)
        return router


ROUTERS_DIR = Path(__file__).parent / "routers"
"""Where kv-sekv's trained routers live: ``<name>.safetensors`` and the ``<name>.json`` sidecar."""


def shipped_routers() -> dict[str, dict[str, Any]]:
    """``{name: sidecar}`` of every router shipped with kv-sekv (the JSON metadata: ``model_id``, ``num_layers``,
    ``num_heads``, ``num_kv_heads``, ``head_dim``, ``config``), sorted by name; no tensor is read."""
    import json

    return {p.stem: json.loads(p.read_text()) for p in sorted(ROUTERS_DIR.glob("*.json"))}


class ShippedRouter:
    """A router shipped with kv-sekv, loaded when first needed.

    Parameters
    ----------
    name : str, optional
        File stem under ``kv_sekv/routers/`` (``"smollm2-135m"``, ``"gemma3-270m"``; :func:`shipped_routers` lists
        them). ``None`` (the default): the shipped router whose KV heads and head dim are those of the cache being
        compressed, chosen at the first compression; a shape that no shipped router (or more than one) has is
        refused with the shapes that are shipped. The choice is by shape, so a model we did not train for that
        happens to share a shipped model's KV shape gets that model's router: name it, or load your own
        (:meth:`SEKVRouter.load`), to be sure.
    """

    def __init__(self, name: str | None = None) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {type(name).__name__}")
        self.name = name
        self._routers: dict[str, SEKVRouter] = {}
        self._chosen: dict[tuple[int, int], str] = {}  # shape -> name: the sidecars are read once per shape

    def path(self, name: str | None = None) -> Path:
        """The tensor file of router ``name`` (this source's name by default)."""
        name = self.name if name is None else name
        if name is None:
            raise ValueError("ShippedRouter() chooses its router by shape: path(name) needs a name")
        return ROUTERS_DIR / f"{name}.safetensors"

    def choose(self, num_kv_heads: int | None, head_dim: int | None) -> str:
        """The name of the router to use for a cache of these shapes (this source's name when it has one)."""
        if self.name is not None:
            return self.name
        if (num_kv_heads, head_dim) in self._chosen:  # every layer and decode step asks again
            return self._chosen[num_kv_heads, head_dim]
        shipped = shipped_routers()
        listed = ", ".join(f"{n!r} ({m['num_kv_heads']} KV heads of dim {m['head_dim']})" for n, m in shipped.items())
        if num_kv_heads is None or head_dim is None:
            raise ValueError(
                "ShippedRouter() chooses the router by the cache's shape: call resolve(num_kv_heads, head_dim), or "
                f"name one of the shipped routers: {listed}"
            )
        fits = [n for n, m in shipped.items() if (m["num_kv_heads"], m["head_dim"]) == (num_kv_heads, head_dim)]
        if len(fits) != 1:
            why = "no shipped router fits" if not fits else f"the shipped routers {fits} all fit"
            raise ValueError(
                f"{why} a cache of {num_kv_heads} KV heads of dim {head_dim}; shipped: {listed}. Train a router "
                "for this model (kv-sekv train) and pass router=kv_sekv.SEKVRouter.load(path), or name one with "
                "ShippedRouter(name)"
            )
        self._chosen[num_kv_heads, head_dim] = fits[0]
        return fits[0]

    def resolve(self, num_kv_heads: int | None = None, head_dim: int | None = None) -> SEKVRouter:
        name = self.choose(num_kv_heads, head_dim)
        if name not in self._routers:
            if not self.path(name).is_file():
                raise ValueError(
                    f"kv-sekv ships no trained router named {name!r} (shipped: {sorted(shipped_routers())}): "
                    "train one with `kv-sekv train` and pass router=kv_sekv.SEKVRouter.load(path), or use "
                    "kv_sekv.SEKVRouter.untrained(...) for tests"
                )
            self._routers[name] = SEKVRouter.load(self.path(name))
        return self._routers[name]

    def __repr__(self) -> str:
        return f"ShippedRouter({self.name!r})"
