"""The forward-pass profile t(b, s_q): the seconds a verification step of b sequences with
trees of s_q nodes takes on this model and device, measured at start-up (`profile_forward`) or
loaded from its file, and read by the measured budget policy (budget_policy.py).

The file is JSON, written atomically, with the setting it was measured under (model, dtype,
threads): `ForwardProfile.load` refuses a profile of another setting.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.model.device import synchronize

if TYPE_CHECKING:
    from sssd.verifier.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_BUDGETS = (1, 2, 4, 8, 16, 32)  # the profile's tree sizes s_q
DEFAULT_BATCHES = (1, 2, 4, 8)
PROFILE_CONTEXT = 256  # cached tokens per sequence while profiling the forward pass


class ForwardProfile:
    """t(b, s_q) in seconds on a grid; interpolated in b (beyond the largest batch measured,
    extrapolated along the last two), looked up in s_q."""

    def __init__(self, batches: Sequence[int], budgets: Sequence[int], seconds: np.ndarray,
                 busy: bool = False) -> None:
        """`busy`: measured while other work ran on the machine (its times are too slow, and
        not evenly so): a later start on a quiet machine measures again."""
        self.batches = list(batches)
        self.budgets = list(budgets)
        self.seconds = np.asarray(seconds, dtype=np.float64)  # [num_batches, num_budgets]
        self.busy = busy
        self._times: dict[tuple[int, int], float] = {}

    def time(self, batch_size: int, budget_index: int) -> float:
        key = (batch_size, budget_index)
        seconds = self._times.get(key)
        if seconds is None:  # a policy asks every step: interpolate once per cell
            column = self.seconds[:, budget_index]
            if batch_size > self.batches[-1] and len(self.batches) > 1:
                # Larger batches than profiled (the profile stops at a few rows, the engine runs
                # dozens): the step grows with the rows at the rate of the last two batches.
                slope = (column[-1] - column[-2]) / (self.batches[-1] - self.batches[-2])
                seconds = float(column[-1] + max(0.0, slope) * (batch_size - self.batches[-1]))
            else:
                seconds = float(np.interp(batch_size, self.batches, column))
            self._times[key] = seconds
        return seconds

    @classmethod
    def measure(cls, forward: Callable[[int, int], float], batches: Sequence[int] = DEFAULT_BATCHES,
                budgets: Sequence[int] = DEFAULT_BUDGETS, rounds: int = 5) -> "ForwardProfile":
        """`forward(b, s)` runs one verification forward and returns its duration in seconds.

        Every (b, s) is timed once per round, rounds one after another, and the median is kept:
        a slow spell of a shared machine then spreads over all cells instead of spoiling some.
        A larger budget never costs less (more rows through the same layers), so the medians are
        made non-decreasing in s, which removes the remaining inversions from noise.
        """
        cells = [(i, j) for i in range(len(batches)) for j in range(len(budgets))]
        for i, j in cells:
            forward(batches[i], budgets[j])  # warm-up
        samples = np.zeros((rounds, len(batches), len(budgets)))
        for r in range(rounds):
            for i, j in cells:
                samples[r, i, j] = forward(batches[i], budgets[j])
        seconds = np.maximum.accumulate(np.median(samples, axis=0), axis=1)
        return cls(batches, budgets, seconds)

    def save(self, path: str | os.PathLike, setting: dict | None = None) -> None:
        """Writes the profile atomically; `setting` says what it was measured with (model,
        dtype, threads), so that `load` can refuse it for another."""
        write_json(path, {"batches": self.batches, "budgets": self.budgets,
                           "seconds": self.seconds.tolist(), "measured_at": time.time(),
                           "busy": self.busy, "setting": setting or {}})

    @classmethod
    def load(cls, path: str | os.PathLike, setting: dict | None = None) -> "ForwardProfile | None":
        """The saved profile, or None when there is none or it was measured with another
        setting."""
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            return None
        if setting is not None and raw.get("setting") != setting:
            logger.info("forward profile %s was measured with %s, not %s: measuring again",
                        path, raw.get("setting"), setting)
            return None
        return cls(raw["batches"], raw["budgets"], np.asarray(raw["seconds"]),
                   busy=bool(raw.get("busy", False)))


def write_json(path: str | os.PathLike, payload: dict) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(payload, f)
    os.replace(temporary, path)


def profiled_batches(max_batch_size: int) -> list[int]:
    """The batch sizes a profile for `max_batch_size` running sequences measures (larger ones
    are extrapolated: ForwardProfile.time)."""
    return [b for b in DEFAULT_BATCHES if b <= max_batch_size]


def profile_forward(runner: "ModelRunner", max_batch_size: int) -> ForwardProfile:
    """Times verification forwards of b sequences x s_q nodes on this model and device.

    Fills the runner's own slots (before any request uses the cache) with a synthetic context;
    nothing is committed, so the runner is left as it was, apart from those blocks' contents."""
    batches = profiled_batches(min(max_batch_size, runner.max_seqs))
    room = runner.slot_row(0).capacity(runner.block_size) if runner.max_seqs else 0
    context = max(1, min(PROFILE_CONTEXT, runner.max_len - max(DEFAULT_BUDGETS) - 1,
                         room - max(DEFAULT_BUDGETS) - 1))
    prompt = list(range(100, 100 + context))
    for slot in range(batches[-1]):
        runner.prefill(slot, prompt)

    def forward(batch_size: int, budget: int) -> float:
        tree = DraftTree(np.arange(200, 200 + budget, dtype=np.int32),
                         np.arange(-1, budget - 1, dtype=np.int32))
        start = time.perf_counter()
        runner.verify([tree] * batch_size)  # nothing is committed: the cache stays as it was
        synchronize(runner.device)  # a GPU pass has only been queued
        return time.perf_counter() - start

    return ForwardProfile.measure(forward, batches=batches)
