"""What a Ray decode worker keeps apart from a server without Ray."""

import time

from sssd.common.rpc.totals import Totals
from sssd.verifier.factory import acceptance_path
from sssd.verifier.serving.backend import StreamEvent
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
