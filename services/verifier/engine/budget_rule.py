"""Speculation budget from the batch size (the SSSD paper, arXiv 2411.05894, Section 3.2 and
Appendix B).

Every linear layer sees `b * s_q` rows; the forward pass costs about the same as plain decoding
until `b * s_q` reaches the knee of the roofline, `I_knee = peak FLOP/s / memory bandwidth`. So
the free speculation budget per sequence is `s_q = I_knee / b`, capped. The measured-cost policy
that chooses s_q from profiled forward times lives with the verifier.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # FLOP/s at the serving dtype
    memory_bandwidth: float  # bytes/s

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.memory_bandwidth <= 0:
            raise ValueError(f"{self.name}: peak_flops and memory_bandwidth must be > 0")

    @property
    def knee_intensity(self) -> float:
        """I_knee in FLOP per byte: the arithmetic intensity where compute starts to bound."""
        return self.peak_flops / self.memory_bandwidth


# Dense bf16 peak and HBM bandwidth from the vendors' data sheets.
H100_SXM = Accelerator("H100-SXM", peak_flops=989e12, memory_bandwidth=3.35e12)
H200 = Accelerator("H200", peak_flops=989e12, memory_bandwidth=4.8e12)
A100_80GB = Accelerator("A100-80GB", peak_flops=312e12, memory_bandwidth=2.0e12)


def speculation_budget(
    batch_size: int,
    knee_intensity: float,
    max_budget: int = 32,
    min_budget: int = 1,
) -> int:
    """s_q = floor(I_knee / b), clamped to [min_budget, max_budget].

    The budget counts the root (the last accepted token), so s_q = 1 means no speculation.
    The paper caps it at 32 at b = 1: beyond that the acceptance gain of extra candidates is
    negligible while attention cost keeps growing.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if knee_intensity <= 0:
        raise ValueError(f"knee_intensity must be > 0, got {knee_intensity}")
    if not 1 <= min_budget <= max_budget:
        raise ValueError(
            f"need 1 <= min_budget <= max_budget, got min_budget={min_budget}, "
            f"max_budget={max_budget}"
        )
    return max(min_budget, min(max_budget, int(knee_intensity // batch_size)))
