"""The in-process drafter: sequence state, validation without side effects, live shard swaps."""

import threading

import numpy as np
import pytest

from sssd import _core
from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import CapacityError, DraftRequest, SequenceNotFound
from sssd.datastore.build import build_datastore
from sssd.datastore.manifest import read_manifest, write_manifest
from sssd.datastore.shard import make_stream, write_shard
from sssd.drafter.config import DrafterConfig, DraftParams
from sssd.drafter.drafter import LocalDrafter

VOCAB = 100
FINGERPRINT = "test-tokenizer"


def corpus(seed: int, count: int = 200) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 40, size=rng.integers(5, 80)) for _ in range(count)]


@pytest.fixture
def datastore_dir(tmp_path):
    build_datastore(tmp_path, corpus(0), VOCAB, FINGERPRINT, shard_tokens=4000)
    return tmp_path


@pytest.fixture
def drafter(datastore_dir):
    config = DrafterConfig(datastore_dir=str(datastore_dir), vocab_size=VOCAB,
                           tokenizer_fingerprint=FINGERPRINT, max_batch_size=4, max_budget=32,
                           max_sequences=3, max_tokens_per_sequence=500, poll_interval_s=0.05)
    drafter = LocalDrafter(config)
    drafter.start()
    yield drafter
    drafter.close()



def check(tree: DraftTree, budget: int, root: int) -> None:
    assert _core.check_draft_tree(tree.token_ids, tree.parents, tree.probs, budget, root) == ""


def test_trees_are_valid_and_continuations_equal_a_restart(drafter):
    context = corpus(0)[3][:20].tolist()
    first = drafter.propose([DraftRequest("a", context, 16, is_start=True)])[0]
    check(first, 16, context[-1])
    assert first.num_nodes == 16  # the sequence is in the datastore: plenty of candidates
    step = drafter.propose([DraftRequest("a", [7, 8], 16)])[0]
    restarted = drafter.propose([DraftRequest("b", context + [7, 8], 16, is_start=True)])[0]
    assert [step] == [restarted]


def test_smaller_budget_tree_is_a_prefix_of_the_larger(drafter):
    # The measured budget policy relies on this: best-first insertion makes the tree of
    # budget s the first s nodes of the tree of any larger budget for the same context.
    for doc in corpus(0)[:3]:
        context = doc[:12].tolist()
        big = drafter.propose([DraftRequest("big", context, 32, is_start=True)])[0]
        for budget in (2, 4, 8, 16):
            small = drafter.propose([DraftRequest("s", context, budget, is_start=True)])[0]
            assert small == DraftTree(big.token_ids[:budget], big.parents[:budget],
                                      big.probs[:budget])
            drafter.end(["s"])
        drafter.end(["big"])


def test_unknown_sequence_is_not_found_and_restart_recovers(drafter):
    with pytest.raises(SequenceNotFound) as info:
        drafter.propose([DraftRequest("x", [1, 2], 8), DraftRequest("y", [1], 8)])
    assert info.value.seq_ids == ["x", "y"]
    assert "re-send the full context" in str(info.value)
    tree = drafter.propose([DraftRequest("x", [1, 2], 8, is_start=True)])[0]
    check(tree, 8, 2)


def test_end_frees_state(drafter):
    drafter.propose([DraftRequest("a", [1, 2, 3], 8, is_start=True)])
    assert drafter.end(["a", "never-seen"]) == 1
    assert drafter.num_sequences == 0
    with pytest.raises(SequenceNotFound):
        drafter.propose([DraftRequest("a", [4], 8)])


@pytest.mark.parametrize(
    "requests, message",
    [
        ([], "empty batch"),
        ([DraftRequest(f"s{i}", [1], 4, True) for i in range(5)], "max_batch_size"),
        ([DraftRequest("a", [1], 4, True), DraftRequest("a", [2], 4, True)], "appears twice"),
        ([DraftRequest("", [1], 4, True)], "non-empty"),
        ([DraftRequest("a", [1, VOCAB], 4)], f"token id {VOCAB} outside"),
        ([DraftRequest("a", [-3], 4)], "token id -3 outside"),
        ([DraftRequest("a", [1], 0)], r"budget 0 outside \[1, 32\]"),
        ([DraftRequest("a", [1], 33)], "budget 33"),
        ([DraftRequest("n", [], 4, True)], "is_start needs the full context"),
        ([DraftRequest("a", [1.5], 4)], "flat list of ints"),
        ([DraftRequest("n", [1] * 501, 4, True)], "max_tokens_per_sequence"),
        ([DraftRequest("a", [1] * 490, 4)], "would hold"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(drafter, requests, message):
    context = corpus(0)[5][:30].tolist()
    drafter.propose([DraftRequest("a", context, 16, is_start=True)])
    with pytest.raises(ValueError, match=message):
        drafter.propose(requests)
    assert drafter.num_sequences == 1
    after = drafter.propose([DraftRequest("a", [9], 16)])
    reference = drafter.propose([DraftRequest("ref", context + [9], 16, is_start=True)])
    assert after == reference


def test_close_releases_the_datastore_and_refuses_later_calls(datastore_dir):
    # The datastore's memory maps are released by close() itself: left to a daemon thread
    # during interpreter shutdown, unmapping aborted the drafter service now and then.
    drafter = LocalDrafter(DrafterConfig(datastore_dir=str(datastore_dir), vocab_size=VOCAB,
                                         tokenizer_fingerprint=FINGERPRINT))
    drafter.start()
    assert drafter.watcher.current is not None
    drafter.close()
    assert drafter.watcher.current is None
    with pytest.raises(RuntimeError, match="closed"):
        drafter.propose([DraftRequest("a", [1, 2], 4, is_start=True)])


def test_sequence_table_capacity(drafter):
    drafter.propose([DraftRequest(f"s{i}", [1, 2], 4, True) for i in range(3)])
    with pytest.raises(CapacityError, match="max_sequences=3"):
        drafter.propose([DraftRequest("s3", [1], 4, True)])
    # Restarting a live sequence needs no new slot.
    drafter.propose([DraftRequest("s0", [5, 6], 4, True)])
    assert drafter.num_sequences == 3


def test_new_manifest_swaps_in_under_concurrent_requests(drafter, datastore_dir):
    # A phrase absent from the first datastore: tokens >= 50 never occur in corpus(0).
    phrase = [60, 61, 62, 63, 64, 65, 66, 67, 68]
    before = drafter.propose([DraftRequest("probe", phrase[:4], 8, True)])[0]
    assert before.num_nodes < 8  # only the input trie knows (part of) the context

    errors: list[BaseException] = []
    stop = threading.Event()

    def hammer(worker: int) -> None:
        rng = np.random.default_rng(worker)
        seq_ids = [f"w{worker}-{i}" for i in range(1)]
        try:
            while not stop.is_set():
                context = rng.integers(0, 40, size=12).tolist()
                drafter.propose([DraftRequest(s, context, 16, True) for s in seq_ids])
                drafter.end(seq_ids)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    old_version = drafter.info()["manifest_version"]
    build_datastore(datastore_dir, [phrase] * 5, VOCAB, FINGERPRINT, shard_tokens=4000,
                    append=True)
    for _ in range(200):
        if drafter.info()["manifest_version"] > old_version:
            break
        threading.Event().wait(0.05)
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert drafter.info()["manifest_version"] == old_version + 1
    after = drafter.propose([DraftRequest("probe2", phrase[:4], 8, True)])[0]
    # The new shard's continuation, cut at its document boundary.
    assert after.token_ids[1:].tolist() == phrase[4:]


def test_damaged_new_shard_keeps_the_old_datastore_serving(drafter, datastore_dir):
    old = read_manifest(datastore_dir)
    write_shard(datastore_dir / "shard-broken", make_stream(corpus(1, 20), VOCAB), VOCAB,
                FINGERPRINT)
    with open(datastore_dir / "shard-broken" / "tokens.u32", "r+b") as f:
        f.write(b"\x01\x00\x00\x00")
    write_manifest(datastore_dir, old.next(old.shards + ("shard-broken",), None))
    assert drafter.watcher.refresh() is False
    assert drafter.info()["manifest_version"] == old.version
    assert "sha256" in drafter.watcher.last_error
    tree = drafter.propose([DraftRequest("a", [1, 2, 3], 8, True)])[0]
    check(tree, 8, 3)


def test_without_a_configured_tokenizer_the_datastores_one_is_reported_and_kept(datastore_dir):
    """A drafter started on a datastore alone reports its shards' tokenizer (what a client
    checks against its model's) and then refuses a shard of another tokenizer."""
    drafter = LocalDrafter(DrafterConfig(datastore_dir=str(datastore_dir), vocab_size=VOCAB,
                                         poll_interval_s=60)).start()
    try:
        assert drafter.info()["tokenizer_fingerprint"] == FINGERPRINT
        old = read_manifest(datastore_dir)
        write_shard(datastore_dir / "shard-foreign", make_stream(corpus(1, 20), VOCAB), VOCAB,
                    "another-tokenizer")
        write_manifest(datastore_dir, old.next(old.shards + ("shard-foreign",), None))
        assert drafter.watcher.refresh() is False
        assert "another-tokenizer"[:12] in drafter.watcher.last_error
        assert drafter.info()["manifest_version"] == old.version
    finally:
        drafter.close()


def test_a_datastore_of_mixed_tokenizers_is_refused(tmp_path):
    build_datastore(tmp_path, corpus(0, 20), VOCAB, "one-tokenizer", shard_tokens=4000)
    build_datastore(tmp_path, corpus(1, 20), VOCAB, "two-tokenizer", shard_tokens=4000,
                    append=True)
    drafter = LocalDrafter(DrafterConfig(datastore_dir=str(tmp_path), vocab_size=VOCAB,
                                         poll_interval_s=60)).start()
    try:
        assert drafter.watcher.current is None
        assert "different tokenizers" in drafter.watcher.last_error
        assert drafter.info()["tokenizer_fingerprint"] == ""
    finally:
        drafter.close()


def test_model_text_shards_are_weighted(tmp_path):
    """A shard of the served model's answers outweighs a corpus shard twice its length at
    weight 5, and is outweighed at weight 1 (the paper's algorithm)."""
    # After [3, 4] the corpus continues with 7 (twice as often), the model's answers with 9.
    build_datastore(tmp_path / "ds", [[3, 4, 7, 7]] * 40, 32, "fp")
    build_datastore(tmp_path / "ds", [[3, 4, 9, 9]] * 20, 32, "fp", append=True,
                    origin="model")
    for weight, first in ((5, 9), (1, 7)):
        config = DrafterConfig(datastore_dir=str(tmp_path / "ds"), vocab_size=32,
                               model_shard_weight=weight)
        with LocalDrafter(config) as drafter:
            quotas = drafter.watcher.current.core.quotas
            (tree,) = drafter.propose([DraftRequest(f"w{weight}", [1, 3, 4], 2, is_start=True)])
        assert tree.token_ids.tolist() == [4, first], weight
        assert quotas == ([29, 71] if weight == 5 else [67, 33])
    # Weights are relative: model shards alone are weighted like a corpus (weight 1), so the
    # stop rule of min_continuations counts the same as in the paper's algorithm.
    build_datastore(tmp_path / "own", [[3, 4, 9, 9]] * 20, 32, "fp", origin="model")
    build_datastore(tmp_path / "own", [[3, 4, 7, 7]] * 10, 32, "fp", append=True,
                    origin="model")
    with LocalDrafter(DrafterConfig(datastore_dir=str(tmp_path / "own"), vocab_size=32)) as drafter:
        datastore = drafter.watcher.current.core
        assert datastore.quotas == [67, 33]
        nodes = datastore.collect(np.asarray([1, 3, 4], dtype=np.int32),
                                  drafter.config.params.to_core())
        # After [3, 4]: 30 continuations (< 50), so [4] adds 30 more; at weight 5 the first 30
        # would have counted 150 and stopped the shortening.
        assert nodes[0, 1] == 60


def test_config_rejects_out_of_range_values():
    with pytest.raises(ValueError, match="max_budget"):
        DrafterConfig(max_budget=0)
    with pytest.raises(ValueError, match="model_shard_weight"):
        DrafterConfig(model_shard_weight=0)
    with pytest.raises(ValueError, match="prefix_len"):
        DraftParams(prefix_len=9)
    with pytest.raises(ValueError, match="discounts"):
        DraftParams(input_discount=1.5)


def test_config_reads_flags_and_environment(monkeypatch):
    monkeypatch.setenv("SSSD_DRAFTER_MAX_BUDGET", "48")
    config = DrafterConfig.from_args(["--port", "0", "--prefix-len", "3", "--no-verify-checksums"])
    assert (config.port, config.max_budget, config.params.prefix_len) == (0, 48, 3)
    assert config.verify_checksums is False
