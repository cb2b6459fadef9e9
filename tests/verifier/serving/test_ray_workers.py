"""What a Ray decode worker keeps apart from a server without Ray."""

import threading
import time

import pytest

from sssd.common.rpc.totals import Totals
from sssd.verifier.factory import acceptance_path
from sssd.verifier.serving.backend import StreamEvent
from sssd.verifier.serving.config import RayConfig
from sssd.verifier.serving.ray_workers import Outbox, decode_worker_profile


def test_a_decode_worker_keeps_its_own_profile_and_acceptance():
    """Its steps share the cores with a prefill worker and Ray's processes: a profile measured
    there must not price a server without Ray (nor the reverse)."""
    local = "var/profiles/forward.json"
    worker = decode_worker_profile(local)
    assert worker == "var/profiles/forward.ray-decode.json"
    assert acceptance_path(worker, "sssd") != acceptance_path(local, "sssd")
    # One that prefills its own prompts runs alone on the cores: a profile of its own too.
    own = decode_worker_profile(local, own_prefill=True)
    assert own == "var/profiles/forward.ray-decode-own-prefill.json"
    assert acceptance_path(own, "sssd") not in (acceptance_path(worker, "sssd"),
                                                 acceptance_path(local, "sssd"))
    assert decode_worker_profile(None) is None  # no profile kept: profiled at every start
    assert decode_worker_profile("") == ""


def _event(tokens=(1,), done=False):
    totals = Totals(prompt_tokens=1, completion_tokens=len(tokens), time_to_first_token_s=0.0,
                    total_s=0.0, tokens_per_second=0.0, mean_accepted_length=0.0,
                    finish_reason="stop") if done else None
    return StreamEvent(list(tokens), "", totals=totals)


def test_an_outbox_batches_the_events_of_all_its_requests_in_order():
    outbox = Outbox()
    a, b = outbox.for_request("a"), outbox.for_request("b")
    first_a, first_b, second_a, last_b = _event((1,)), _event((2,)), _event((3, 4)), \
        _event((), done=True)
    for events, event in ((a, first_a), (b, first_b), (a, second_a), (b, last_b)):
        events.put(event)
    assert outbox.take(1.0) == [("a", first_a), ("b", first_b), ("a", second_a),
                                ("b", last_b)]
    start = time.monotonic()
    assert outbox.take(0.05) == []  # nothing left: waits the timeout
    assert time.monotonic() - start >= 0.04


def test_the_stream_interval_holds_back_only_the_middle_of_an_answer():
    """A request's first event and its last go out at once; the tokens in between wait for
    the interval, so that a worker sends one batch per interval, not one per step."""
    outbox = Outbox()
    events = outbox.for_request("r")
    events.put(_event((1,)))  # the first: urgent
    start = time.monotonic()
    assert len(outbox.take(1.0, not_before=start + 5.0)) == 1
    assert time.monotonic() - start < 1.0
    events.put(_event((2,)))
    events.put(_event((3,)))
    start = time.monotonic()
    assert [e.token_ids for _, e in outbox.take(1.0, not_before=start + 0.2)] == [[2], [3]]
    assert time.monotonic() - start >= 0.15  # held until the interval was over
    events.put(_event((4,)))
    # The end arrives while the middle waits: both go out at once.
    threading.Timer(0.05, events.put, args=(_event((), done=True),)).start()
    start = time.monotonic()
    batch = outbox.take(1.0, not_before=start + 5.0)
    assert [e.token_ids for _, e in batch] == [[4], []] and batch[-1][1].totals is not None
    assert time.monotonic() - start < 2.0
    # A new request's first event is urgent again.
    outbox.for_request("s").put(_event((5,)))
    start = time.monotonic()
    assert outbox.take(1.0, not_before=start + 5.0) and time.monotonic() - start < 1.0


def test_the_stream_interval_is_checked():
    assert RayConfig(stream_interval_ms=0).stream_interval_ms == 0
    for bad in (-1, 5000):
        with pytest.raises(ValueError, match="stream_interval_ms"):
            RayConfig(stream_interval_ms=bad)
