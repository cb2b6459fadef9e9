"""Shards and manifests on disk: round trip, refusal of damaged or foreign shards, atomicity."""

import json
import os

import numpy as np
import pytest

from sssd import _core
from sssd.datastore.build import build_datastore
from sssd.datastore.manifest import Manifest, ManifestError, read_manifest, write_manifest
from sssd.datastore.shard import (
    SEPARATOR,
    ShardError,
    bucket_starts,
    datastore_meta,
    load_shard,
    make_stream,
    read_meta,
    write_shard,
)

VOCAB = 64
FINGERPRINT = "test-tokenizer"


def random_documents(seed: int, count: int = 40) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=rng.integers(1, 60)) for _ in range(count)]


def test_make_stream_separates_documents_and_skips_empty_ones():
    stream = make_stream([[1, 2], [], [3]], VOCAB)
    assert stream.tolist() == [1, 2, int(SEPARATOR), 3, int(SEPARATOR)]


def test_make_stream_names_the_bad_document():
    with pytest.raises(ValueError, match=r"document 1 has token id 64"):
        make_stream([[1], [2, 64]], VOCAB)
    with pytest.raises(ValueError, match=r"token id -1"):
        make_stream([[-1]], VOCAB)


def test_round_trip_preserves_arrays_and_metadata(tmp_path):
    stream = make_stream(random_documents(0), VOCAB)
    meta = write_shard(tmp_path / "s", stream, VOCAB, FINGERPRINT, "1-0", "9-0")
    shard = load_shard(tmp_path / "s", VOCAB, FINGERPRINT)
    assert isinstance(shard.stream, np.memmap)  # mapped, not read into the heap
    np.testing.assert_array_equal(shard.stream, stream)
    np.testing.assert_array_equal(shard.suffix_array, _core.build_suffix_array(stream, VOCAB))
    np.testing.assert_array_equal(shard.bucket_starts, bucket_starts(stream, VOCAB))
    assert shard.meta == meta
    assert (meta.source_first, meta.source_last) == ("1-0", "9-0")
    assert meta.num_documents == 40 and meta.num_tokens == stream.shape[0]
    datastore = _core.Datastore([shard.core_view()], VOCAB, 100)
    assert datastore.check_shard(0, True) == ""


def test_origin_is_written_read_and_checked(tmp_path):
    stream = make_stream(random_documents(3), VOCAB)
    assert write_shard(tmp_path / "corpus", stream, VOCAB, FINGERPRINT).origin == "corpus"
    assert write_shard(tmp_path / "own", stream, VOCAB, FINGERPRINT, origin="model").origin == \
        "model"
    assert read_meta(tmp_path / "own").origin == "model"
    with pytest.raises(ValueError, match="origin must be one of"):
        write_shard(tmp_path / "bad", stream, VOCAB, FINGERPRINT, origin="served")
    assert not (tmp_path / "bad").exists()
    # meta.json written before the field existed: an offline corpus.
    meta_path = tmp_path / "corpus" / "meta.json"
    raw = json.loads(meta_path.read_text())
    del raw["origin"]
    meta_path.write_text(json.dumps(raw))
    assert read_meta(tmp_path / "corpus").origin == "corpus"
    raw["origin"] = "elsewhere"
    meta_path.write_text(json.dumps(raw))
    with pytest.raises(ShardError, match="origin 'elsewhere'"):
        load_shard(tmp_path / "corpus", VOCAB, FINGERPRINT)


def test_suffix_array_orders_suffixes(tmp_path):
    stream = make_stream(random_documents(1, 10), VOCAB)
    suffix_array = _core.build_suffix_array(stream, VOCAB)
    values = stream.tolist()
    assert suffix_array.tolist() == sorted(range(len(values)), key=lambda i: values[i:])


def test_shards_are_immutable(tmp_path):
    stream = make_stream(random_documents(2), VOCAB)
    write_shard(tmp_path / "s", stream, VOCAB, FINGERPRINT)
    with pytest.raises(FileExistsError):
        write_shard(tmp_path / "s", stream, VOCAB, FINGERPRINT)


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("flip_sa", "sha256"),
        ("truncate_tokens", "truncated"),
        ("delete_buckets", "missing buckets.u32"),
        ("garble_meta", "malformed JSON"),
        ("delete_meta", "no meta.json"),
    ],
)
def test_damaged_shard_is_refused_with_the_reason(tmp_path, damage, reason):
    write_shard(tmp_path / "s", make_stream(random_documents(3), VOCAB), VOCAB, FINGERPRINT)
    directory = tmp_path / "s"
    if damage == "flip_sa":
        with open(directory / "sa.u32", "r+b") as f:
            f.seek(8)
            byte = f.read(1)
            f.seek(8)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate_tokens":
        os.truncate(directory / "tokens.u32", 12)
    elif damage == "delete_buckets":
        os.remove(directory / "buckets.u32")
    elif damage == "garble_meta":
        (directory / "meta.json").write_text("{not json")
    elif damage == "delete_meta":
        os.remove(directory / "meta.json")
    with pytest.raises(ShardError, match=reason):
        load_shard(directory, VOCAB, FINGERPRINT)


def test_foreign_tokenizer_or_vocabulary_is_refused(tmp_path):
    write_shard(tmp_path / "s", make_stream(random_documents(4), VOCAB), VOCAB, FINGERPRINT)
    with pytest.raises(ShardError, match="tokenizer"):
        load_shard(tmp_path / "s", VOCAB, "another-tokenizer")
    with pytest.raises(ShardError, match="vocab_size"):
        load_shard(tmp_path / "s", VOCAB + 1, FINGERPRINT)


def test_a_datastore_says_the_vocabulary_its_shards_were_built_for(tmp_path):
    assert datastore_meta(tmp_path) is None  # no manifest yet
    assert datastore_meta(tmp_path / "missing") is None
    build_datastore(tmp_path, random_documents(8, 10), VOCAB + 7, FINGERPRINT)
    meta = datastore_meta(tmp_path)
    assert (meta.vocab_size, meta.tokenizer_fingerprint) == (VOCAB + 7, FINGERPRINT)


def test_manifest_replacement_is_atomic_and_versioned(tmp_path):
    assert read_manifest(tmp_path) is None
    manifest = build_datastore(tmp_path, random_documents(5, 100), VOCAB, FINGERPRINT,
                               shard_tokens=500)
    assert manifest.version == 1 and len(manifest.shards) >= 3
    assert read_manifest(tmp_path) == manifest
    second = build_datastore(tmp_path, random_documents(6, 10), VOCAB, FINGERPRINT,
                             shard_tokens=500, max_shards=2, append=True)
    assert second.version == 2
    assert len(second.shards) == 2 and second.shards[-1] not in manifest.shards
    # Only the manifest itself remains: no temporary file is left behind.
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_manifest_must_name_existing_shards(tmp_path):
    with pytest.raises(ValueError, match="not in"):
        write_manifest(tmp_path, Manifest(version=1, shards=("shard-000000",)))


def test_malformed_manifest_is_reported(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 1, "version": "x"}))
    with pytest.raises(ManifestError, match="malformed"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 99}))
    with pytest.raises(ManifestError, match="format_version"):
        read_manifest(tmp_path)


def test_documents_never_span_shards(tmp_path):
    documents = random_documents(7, 60)
    manifest = build_datastore(tmp_path, documents, VOCAB, FINGERPRINT, shard_tokens=300)
    rebuilt = []
    for name in manifest.shards:
        shard = load_shard(tmp_path / name, VOCAB, FINGERPRINT)
        assert shard.meta.num_tokens <= 300
        values = shard.stream.tolist()
        document = []
        for token in values:
            if token == int(SEPARATOR):
                rebuilt.append(document)
                document = []
            else:
                document.append(token)
        assert document == []  # every shard ends on a separator
    assert rebuilt == [d.tolist() for d in documents]
