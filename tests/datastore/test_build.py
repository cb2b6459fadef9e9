"""Building datastores: no silent doubling of a corpus, the JSONL forms the project's own
commands write, reading documents back, hard-linked copies."""

import json

import pytest

from sssd import _core
from sssd.datastore.build import (
    build_datastore,
    link_datastore,
    main,
    read_documents,
    read_token_documents,
)
from sssd.datastore.manifest import read_manifest
from sssd.datastore.shard import SEPARATOR

VOCAB = 64
FINGERPRINT = "test-tokenizer"


def test_the_separator_is_the_cores():
    assert int(SEPARATOR) == _core.DOCUMENT_SEPARATOR


def test_building_into_a_datastore_is_refused_unless_appending(tmp_path):
    build_datastore(tmp_path, [[1, 2, 3]], VOCAB, FINGERPRINT)
    with pytest.raises(FileExistsError, match="already holds a datastore"):
        build_datastore(tmp_path, [[4, 5]], VOCAB, FINGERPRINT)
    assert read_documents(tmp_path) == [[1, 2, 3]]  # the refusal changed nothing
    build_datastore(tmp_path, [[4, 5]], VOCAB, FINGERPRINT, append=True)
    assert read_documents(tmp_path) == [[1, 2, 3], [4, 5]]


def test_the_cli_reads_what_the_project_writes(tmp_path):
    corpus = tmp_path / "documents.jsonl"
    records = [[1, 2, 3],  # a bare list
               {"token_ids": [4, 5]},
               {"record": 7, "prompt_ids": [6, 7], "output_ids": [8, 9],  # sssd-self-outputs
                "finish_reason": "stop"},
               {"record": 8, "skipped": "prompt too long"}]
    corpus.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    target = tmp_path / "ds"
    arguments = [str(target), str(corpus), "--vocab-size", str(VOCAB),
                 "--tokenizer-fingerprint", FINGERPRINT]
    assert main(arguments) == 0
    assert read_documents(target) == [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert main(arguments) == 1  # again into the same directory: refused, nothing doubled
    assert read_documents(target) == [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert main([*arguments, "--append"]) == 0
    assert len(read_documents(target)) == 6


def test_a_bad_line_is_named(tmp_path):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('[1, 2]\n{"text": "not token ids"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a list of token ids"):
        list(read_token_documents(corpus))


def test_link_datastore_shares_the_shards_without_touching_the_source(tmp_path):
    source, target = tmp_path / "source", tmp_path / "live"
    build_datastore(source, [[1, 2], [3]], VOCAB, FINGERPRINT)
    linked = link_datastore(source, target)
    assert linked.shards == read_manifest(source).shards
    assert read_documents(target) == read_documents(source)
    build_datastore(target, [[9]], VOCAB, FINGERPRINT, append=True)  # the live one grows
    assert read_documents(source) == [[1, 2], [3]]
