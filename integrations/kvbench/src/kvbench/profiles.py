"""Run profiles: how many samples, windows and tokens a kvbench run uses unless its options say otherwise.

``quick`` (the default) is today's smoke-test size: the default grid finishes in about two minutes on an idle
2-core CPU (126 s measured, loading the model included). ``paper`` is sized for confidence intervals narrow enough
to separate methods: 32 continuation windows of 1,000 tokens and 50 samples per task at 2,000 tokens (5 depths x
10).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PROFILES", "Profile"]


@dataclass(frozen=True)
class Profile:
    """Defaults of one profile (each one an option of the same name)."""

    tasks: str
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    samples: int
    kl_samples: int
    kl_context: int
    kl_continuation: int

    def describe(self) -> str:
        return (
            f"tasks {self.tasks} at {','.join(map(str, self.lengths))} tokens, depths "
            f"{','.join(f'{d:g}' for d in self.depths)} x {self.samples} samples, {self.kl_samples} KL windows of "
            f"{self.kl_context} + {self.kl_continuation} tokens"
        )


PROFILES: dict[str, Profile] = {
    "quick": Profile("passkey,niah_single", (1000,), (0.2, 0.5, 0.8), 1, 2, 1000, 64),
    "paper": Profile("passkey,niah_single", (2000,), (0.1, 0.3, 0.5, 0.7, 0.9), 10, 32, 1000, 64),
}
