"""Fixtures shared by more than one test package.

The model and everything derived from it (prompts, greedy references, a datastore of the model's
own answers, engines) are loaded once per session, lazily: a test that needs none of them loads
nothing (the fast tier, `pytest -m "not model"`, see pytest_collection_modifyitems).
"""

import pytest

NUM_PROMPTS = 8  # MT-Bench first turns, mixed lengths; each costs a reference generate()
MAX_NEW_TOKENS = 64

# Fixtures that load the model (weights or tokenizer); a test using any of them is marked
# `model` automatically. Tests that load it another way (a subprocess) carry the mark.
MODEL_FIXTURES = {"tokenizer", "target_model_fp32", "target_model_bf16", "mt_bench_prompts",
                  "greedy_references", "warm_datastore", "engine_factory", "make_speculator"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer, loaded once per session (from the on-disk cache when warm)."""
    # No skip when the model package is missing: scripts/setup.sh installs it, so its absence is
    # a broken set-up that must fail loudly.
    from sssd.common.model.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def target_model_fp32():
    """The default model in float32 (a LoadedModel), loaded once per session.

    From the converted-weights cache when warm (about 1-3 s); the first run on a machine pays
    the GGUF conversion (about 15 s) and fills the cache.
    """
    from sssd.common.model.loader import load_causal_lm

    return load_causal_lm(None, "float32")


@pytest.fixture(scope="session")
def target_model_bf16():
    """The default model in bfloat16, the serving default, loaded once per session."""
    from sssd.common.model.loader import load_causal_lm

    return load_causal_lm(None, "bfloat16")


@pytest.fixture(scope="session")
def wait_until():
    """wait_until(condition, timeout=10.0): polls until condition() is true; False on timeout."""
    import time

    def wait(condition, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.02)
        return False

    return wait


@pytest.fixture(scope="session")
def free_port():
    """free_port(): a TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    def pick():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return pick


@pytest.fixture(scope="session")
def mt_bench_prompts(target_model_fp32):
    from sssd.common.data.corpus import first_turns, read_mt_bench

    tokenizer = target_model_fp32.tokenizer
    prompts = []
    for text in first_turns(read_mt_bench())[:NUM_PROMPTS]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


@pytest.fixture(scope="session")
def greedy_references(target_model_fp32, mt_bench_prompts):
    """Plain greedy decoding by transformers' own generate(), one prompt at a time."""
    import torch

    model = target_model_fp32.model
    references = []
    with torch.inference_mode():
        for prompt in mt_bench_prompts:
            output = model.generate(torch.tensor([prompt]), do_sample=False,
                                    max_new_tokens=MAX_NEW_TOKENS)
            references.append(output[0, len(prompt):].tolist())
    return references


@pytest.fixture(scope="session")
def warm_datastore(tmp_path_factory, target_model_fp32, greedy_references):
    """A datastore holding the model's own answers to half the prompts, plus unrelated noise."""
    import numpy as np

    from sssd.datastore.build import build_datastore

    directory = tmp_path_factory.mktemp("datastore")
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, target_model_fp32.vocab_size, size=200) for _ in range(50)]
    build_datastore(directory, greedy_references[::2] + noise, target_model_fp32.vocab_size,
                    target_model_fp32.fingerprint, shard_tokens=8000)
    return str(directory)


@pytest.fixture(scope="session")
def engine_factory(target_model_fp32):
    """make(max_batch_size, datastore_dir=None, proposer="inproc" | None | a Proposer) ->
    (engine, drafter); "inproc" builds an in-process SSSD drafter, None decodes
    autoregressively. The engine tracks text (stop strings). `loaded`: another LoadedModel than
    the float32 one; `attention`: EngineConfig.attention."""

    def make(max_batch_size, datastore_dir=None, proposer="inproc", max_budget=16, loaded=None,
             attention="sdpa"):
        return make_engine(loaded or target_model_fp32, max_batch_size, datastore_dir, proposer,
                           max_budget, attention)

    return make


def make_engine(loaded, max_batch_size, datastore_dir=None, proposer="inproc", max_budget=16,
                attention="sdpa"):
    from sssd.drafter.config import DrafterConfig
    from sssd.drafter.drafter import LocalDrafter
    from sssd.verifier.engine import Engine
    from sssd.verifier.engine.budget_policy import RuleBudget
    from sssd.verifier.engine.model_runner import ModelRunner

    runner = ModelRunner(loaded.model, max_seqs=max_batch_size, max_len=1024, attention=attention)
    drafter = None
    if proposer == "inproc":
        drafter = LocalDrafter(DrafterConfig(datastore_dir=datastore_dir,
                                             vocab_size=loaded.vocab_size,
                                             tokenizer_fingerprint=loaded.fingerprint,
                                             num_threads=1))
        drafter.start()
    elif proposer is not None:
        drafter = proposer
    tokenizer = loaded.tokenizer
    engine = Engine(runner, loaded.eos_token_ids, RuleBudget(32.0, max_budget), drafter,
                    detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                    max_batch_size=max_batch_size)
    return engine, drafter


class FakeProposer:
    """A `Proposer` in memory for routing tests: records each call's sequence ids and each
    sequence's context, drafts a chain of `num_drafts` tokens (1, 2, ...) after the last token,
    loses the ids in `lose` (SequenceNotFound) and raises `failure` while it is set."""

    sources = ("sssd",)
    hindsight_drafts = False

    def __init__(self, num_drafts: int = 0) -> None:
        self.num_drafts = num_drafts
        self.contexts: dict[str, list[int]] = {}
        self.calls: list[list[str]] = []
        self.lose: set[str] = set()
        self.failure: Exception | None = None
        self.closed = 0

    def propose(self, requests):
        import numpy as np

        from sssd.common.drafting.draft_tree import DraftTree
        from sssd.common.drafting.proposer import SequenceNotFound

        self.calls.append([r.seq_id for r in requests])
        if self.failure is not None:
            raise self.failure
        missing = [r.seq_id for r in requests if r.seq_id in self.lose
                   or (not r.is_start and r.seq_id not in self.contexts)]
        if missing:
            raise SequenceNotFound(missing)
        for r in requests:
            if r.is_start:
                self.contexts[r.seq_id] = list(r.token_ids)
            else:
                self.contexts[r.seq_id].extend(r.token_ids)
        chain = list(range(1, self.num_drafts + 1))
        return [DraftTree(np.array([self.contexts[r.seq_id][-1], *chain], dtype=np.int32),
                          np.arange(-1, self.num_drafts, dtype=np.int32)) for r in requests]

    def end(self, seq_ids):
        if self.failure is not None:
            raise self.failure
        return sum(self.contexts.pop(s, None) is not None for s in seq_ids)

    def stats(self):
        return {}

    def close(self):
        self.closed += 1


@pytest.fixture(scope="session")
def fake_proposer():
    """The FakeProposer class (tests cannot import each other's modules)."""
    return FakeProposer


@pytest.fixture
def spawn_service():
    """spawn(args, drain=False) -> (process, port): starts a service command that logs
    "listening on 127.0.0.1:PORT" (INFO) with stderr piped, and returns once it has. `drain`:
    a thread reads the rest of stderr (so a chatty process never blocks on a full pipe), else
    the caller may read it. Every process spawned is killed at teardown, if still running."""
    import os
    import re
    import subprocess
    import threading

    processes = []

    def spawn(args, drain=False):
        process = subprocess.Popen(args, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "SSSD_LOG_LEVEL": "INFO"})
        processes.append(process)
        for line in process.stderr:
            if match := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                if drain:
                    threading.Thread(target=process.stderr.read, daemon=True).start()
                return process, int(match.group(1))
        raise AssertionError(f"{' '.join(args[:3])} exited with {process.wait()} before it "
                             "reported its port")

    yield spawn
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        process.stderr.close()


def make_ca(directory, name: str, server_names=()):
    """A self-signed CA named `name` in `directory`, with a server certificate (127.0.0.1,
    localhost and `server_names`) and a client certificate it signed: {"ca": path,
    "server": (cert, key), "client": (cert, key)}."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .sign(ca_key, hashes.SHA256()))

    def pem_key(key):
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def issue(common_name: str, usages, sans):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                               common_name)]))
                   .issuer_name(ca_name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        cert_path = directory / f"{name}-{common_name}.crt"
        key_path = directory / f"{name}-{common_name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(pem_key(key))
        return str(cert_path), str(key_path)

    ca_path = directory / f"{name}-ca.crt"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    # The server certificate may also identify its process as a client (one identity per
    # service, as `sssd up --tls-*` uses it).
    server = issue("server", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                   [x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.DNSName("localhost"), *map(x509.DNSName, server_names)])
    client = issue("client", [ExtendedKeyUsageOID.CLIENT_AUTH], [])
    return {"ca": str(ca_path), "server": server, "client": client}


@pytest.fixture(scope="session")
def ca_factory():
    """make_ca, for a test that needs a CA of its own (other server names)."""
    return make_ca


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """Two unrelated CAs, "ours" and "theirs", each with server and client certificates."""
    directory = tmp_path_factory.mktemp("pki")
    return {"ours": make_ca(directory, "ours"), "theirs": make_ca(directory, "theirs")}
