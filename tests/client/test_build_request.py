"""The client library refuses what a request message cannot carry, naming the field; the CLI
turns that into one line, not a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

from sssd.client import build_request


@pytest.mark.parametrize("options,field", [
    (dict(max_tokens=-5), "max_tokens: -5 is outside [0, 4294967295]"),
    (dict(top_k=-1), "top_k: -1 is outside [0, 4294967295]"),
    (dict(seed=-1), "seed: -1 is outside [0, 18446744073709551615]"),
    (dict(speculation="fast"), "speculation: must be one of auto, off, sssd"),
])
def test_values_the_message_cannot_carry_are_refused(options, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        build_request("hi", **options)


def test_a_valid_request_carries_every_field():
    request = build_request([1, 2, 3], max_tokens=7, temperature=0.5, top_p=0.9, top_k=4,
                            seed=11, stop=["x"], speculation="off")
    assert list(request.tokens.token_ids) == [1, 2, 3]
    assert (request.max_tokens, request.top_k, request.seed, list(request.stop)) == \
        (7, 4, 11, ["x"])
    assert request.temperature == pytest.approx(0.5) and request.top_p == pytest.approx(0.9)


@pytest.mark.parametrize("flag,value", [("--max-tokens", "-5"), ("--top-k", "-1"),
                                        ("--seed", "-1")])
def test_the_cli_prints_one_line_for_a_bad_value(flag, value):
    sssd = Path(sys.executable).with_name("sssd")
    done = subprocess.run([str(sssd), "generate", "hi", flag, value, "--target",
                           "127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert flag.lstrip("-").replace("-", "_") in done.stderr
