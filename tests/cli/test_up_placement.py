"""Where `sssd up` drafts: in the engine's process or through the drafter service."""

import argparse

import pytest

from sssd.cli.up import add_arguments, drafter_placement
from sssd.verifier.serving.config import RayConfig


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(flags))


@pytest.mark.parametrize("flags, decode_workers, cpus, in_process", [
    ((), None, 2, True),  # one engine on a small machine: no round trip a step
    (("--no-ray",), None, 2, True),
    ((), None, 4, False),  # a machine that can give the service cores of its own
    ((), 2, 2, False),  # engines that share one drafter
    (("--no-ray",), 2, 2, True),  # without Ray there is one engine whatever Ray would start
    (("--speculator",), None, 2, False),  # the speculator's fallback stays the service
    (("--drafter-service",), None, 2, False),
    (("--drafter-in-process",), None, 16, True),
    (("--drafter-in-process", "--speculator"), 3, 16, True),
])
def test_drafter_placement(flags, decode_workers, cpus, in_process):
    in_process_now, reason = drafter_placement(
        parse(*flags), RayConfig(num_decode_workers=decode_workers), cpus)
    assert in_process_now is in_process
    chosen = [flag for flag in ("--drafter-in-process", "--drafter-service") if flag in flags]
    if chosen:  # a flag decided, and the line says so
        assert reason == chosen[0]
    elif in_process:
        assert f"one engine on {cpus} cores" in reason
    else:
        assert reason == "the drafter service"


def test_the_two_drafter_flags_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        parse("--drafter-service", "--drafter-in-process")
    assert "not allowed with argument" in capsys.readouterr().err
