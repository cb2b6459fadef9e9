"""Which sequences wait and which run, and which KV-cache slot each running one owns.

The running batch always occupies slots [0, num_running): `running[i]` owns slot i, so a
step's forward pass attends over one contiguous view of the cache. When a sequence leaves, the
last running one moves into its slot (`move_slot`, the model runner's copy).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from sssd.verifier.engine.sequence import Sequence


class Scheduler:
    def __init__(self, max_batch_size: int, move_slot: Callable[[int, int], None]) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.max_batch_size = max_batch_size
        self._move_slot = move_slot  # move_slot(source, target): a sequence's KV to a slot
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i] owns KV slot i

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.max_batch_size

    def admit(self) -> tuple[int, Sequence]:
        """The oldest waiting sequence joins the batch; returns its slot and the sequence."""
        seq = self.waiting.popleft()
        self.running.append(seq)
        return len(self.running) - 1, seq

    def retire(self) -> list[Sequence]:
        """Removes finished sequences from the batch, keeping the rest in slots
        [0, num_running); returns them in batch order."""
        finished = [seq for seq in self.running if seq.is_finished]
        for seq in finished:
            slot = self.running.index(seq)
            last = len(self.running) - 1
            if slot != last:
                self._move_slot(last, slot)
                self.running[slot] = self.running[last]
            self.running.pop()
        return finished

    def abort(self, request_id: str) -> Sequence | None:
        """Ends a waiting or running sequence now ("cancelled"); None when it is not here."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = "cancelled"
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                seq.finish_reason = "cancelled"
                self.retire()
                return seq
        return None
