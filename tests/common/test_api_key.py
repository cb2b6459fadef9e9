"""The API key: where it comes from, what matches it, and the gRPC interceptor's choice of
which services it guards."""

import argparse
import os

import pytest

from sssd.common.rpc.api_key import (
    ApiKey,
    add_api_key_flags,
    api_key_from_args,
    call_metadata,
    resolve_key,
)


def test_matches_only_the_bearer_token_itself():
    key = ApiKey("s3cret-key")
    assert key.matches("Bearer s3cret-key")
    assert key.matches("bearer s3cret-key")  # the scheme is case-insensitive (RFC 7235)
    for wrong in (None, "", "s3cret-key", "Bearer ", "Bearer s3cret-ke", "Bearer s3cret-key2",
                  "Basic s3cret-key", "Bearer S3CRET-KEY"):
        assert not key.matches(wrong), wrong


@pytest.mark.parametrize("bad", ["", " padded ", "two\nlines"])
def test_malformed_keys_are_refused(bad):
    with pytest.raises(ValueError, match="API key"):
        ApiKey(bad)


def test_resolution_order_flag_file_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    environ = {"SSSD_API_KEY": "from-env"}
    assert resolve_key("from-flag", str(key_file), environ) == "from-flag"
    assert resolve_key(None, str(key_file), environ) == "from-file"
    assert resolve_key(None, None, environ | {"SSSD_API_KEY_FILE": str(key_file)}) == "from-file"
    assert resolve_key(None, None, environ) == "from-env"
    assert resolve_key(None, None, {}) is None
    with pytest.raises(ValueError, match="missing"):
        resolve_key(None, str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        resolve_key(None, str(tmp_path / "empty"), {})


def test_flags_export_the_key_for_this_process_clients(monkeypatch):
    # A copy of the environment: the key exported here must not reach the session's other
    # tests (their servers and clients read SSSD_API_KEY).
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if not k.startswith("SSSD_API_KEY")})
    parser = argparse.ArgumentParser()
    add_api_key_flags(parser)
    assert api_key_from_args(parser.parse_args([])) is None
    assert "SSSD_API_KEY" not in os.environ
    assert api_key_from_args(parser.parse_args(["--api-key", "k1"])) == "k1"
    assert os.environ["SSSD_API_KEY"] == "k1"
    assert call_metadata("k1") == (("authorization", "Bearer k1"),)
    assert call_metadata(None) == ()
