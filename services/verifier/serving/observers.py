"""What watches an engine loop: the `LoopObserver` hooks, several observers as one, the
observer that keeps the measured budget policy's acceptance statistics on disk, and the step
trace.

The metrics (metrics.py) and the live datastore's conversation sink (publish.py) are observers
too; assembly.py puts a loop and its observers together.
"""

from __future__ import annotations

import json
import logging
import os
import time

from sssd.common.rpc.totals import Totals
from sssd.verifier.engine.budget_policy import MeasuredBudget
from sssd.verifier.engine.output import StepOutput
from sssd.verifier.engine.sequence import Sequence
from sssd.verifier.serving.backend import EngineGauges
from sssd.verifier.serving.errors import StreamError

logger = logging.getLogger(__name__)

SAVE_EVERY = 100  # verification steps between saves of the acceptance statistics


class LoopObserver:
    """Hooks for metrics and sinks; called on the loop thread, so they must be quick."""

    def on_step(self, step: StepOutput, step_s: float) -> None:
        """After every engine step; `step_s` is its wall time."""

    def on_finish(self, seq: Sequence | None, totals: Totals | None,
                  error: StreamError | None) -> None:
        """A request ended: with its sequence and totals (finished or cancelled), or with an
        error (then `seq` may be None)."""

    def on_queue(self, gauges: EngineGauges) -> None:
        """The engine's gauges (its KV cache's use, running and queued requests), once per
        loop pass."""

    def close(self) -> None:
        """The loop has stopped: release resources (connections, background threads)."""


class Observers(LoopObserver):
    """Several observers as one, called in order."""

    def __init__(self, *observers: LoopObserver) -> None:
        self.observers = observers

    def on_step(self, step: StepOutput, step_s: float) -> None:
        for observer in self.observers:
            observer.on_step(step, step_s)

    def on_finish(self, seq: Sequence | None, totals: Totals | None,
                  error: StreamError | None) -> None:
        for observer in self.observers:
            observer.on_finish(seq, totals, error)

    def on_queue(self, gauges: EngineGauges) -> None:
        for observer in self.observers:
            observer.on_queue(gauges)

    def close(self) -> None:
        for observer in self.observers:
            observer.close()


class AcceptanceSaver(LoopObserver):
    """Saves the measured budget policy's acceptance estimates every SAVE_EVERY verification
    steps and when the loop stops: the next start takes them as its prior
    (`acceptance_estimates.load_acceptance`), so a restarted server speculates from its first
    step."""

    def __init__(self, policy: MeasuredBudget, path: str | os.PathLike) -> None:
        self.policy = policy
        self.path = path
        self._num_steps = 0

    def on_step(self, step: StepOutput, step_s: float) -> None:
        if not step.num_verified:
            return
        self._num_steps += 1
        if self._num_steps % SAVE_EVERY == 0:
            self._save()

    def close(self) -> None:
        if self._num_steps:
            self._save()

    def _save(self) -> None:
        try:
            self.policy.save_stats(self.path)
        except OSError as exc:  # a full or read-only disk must not stop serving
            logger.warning("could not save the acceptance statistics to %s: %s", self.path, exc)


class StepTrace(LoopObserver):
    """One JSON line per engine step appended to a file (`EngineConfig.step_trace`): when it
    ended (unix seconds), its wall time, how many rows it verified and prompts it admitted, the
    step's budget, each verified row's budget, drafted and accepted tokens, and the seconds in
    the proposer, the verification and the prefill. Enough to see where a run's time went and
    what the budget policy chose, step by step; lines are written as the steps end, so a trace
    can be read while the server runs."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = path
        try:
            self._file = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered
        except OSError as exc:
            raise ValueError(f"step_trace: cannot write {path}: {exc}") from exc

    def on_step(self, step: StepOutput, step_s: float) -> None:
        if self._file.closed:  # closed, or given up after a write failed
            return
        verified = [row for row in step.rows if row.is_verified]
        line = {"t": round(time.time(), 4), "step_s": round(step_s, 6),
                "rows": step.num_verified, "prompts": len(step.rows) - len(verified),
                "budget": step.budget, "row_budgets": [row.budget for row in verified],
                "drafted": [row.num_drafted for row in verified],
                "accepted": [row.num_accepted for row in verified],
                "draft_s": round(step.draft_s, 6), "verify_s": round(step.verify_s, 6),
                "prefill_s": round(step.prefill_s, 6), "fallback": step.is_draft_fallback}
        try:
            self._file.write(json.dumps(line) + "\n")
        except (OSError, ValueError) as exc:  # a full disk must not stop serving
            logger.warning("step trace %s: %s; no longer written", self.path, exc)
            self.close()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
