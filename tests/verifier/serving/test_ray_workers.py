"""What a Ray decode worker keeps apart from a server without Ray."""

from sssd.verifier.factory import acceptance_path
from sssd.verifier.serving.ray_workers import decode_worker_profile


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
