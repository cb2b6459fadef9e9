"""vLLM verifies, the SSSD drafter service drafts: a proposer class for vLLM's `custom_class`
speculative method.

    LLM(model=..., speculative_config={"method": "custom_class",
                                       "model": "sssd.vllm.proposer.VllmDrafterProposer",
                                       "num_speculative_tokens": 8})

and the drafter's address in vLLM's `additional_config={"sssd": {"drafter": "host:port"}}`
(`vllm serve --additional-config '{"sssd": {...}}'`) or in the environment of vLLM's workers as
SSSD_VLLM_DRAFTER=host:port; h1:p1,h2:p2 or dns:///NAME:PORT give several replicas with sticky
routing. See `ProposerSettings` for the other fields (the config's win over the environment's). vLLM
builds the class in each worker with its VllmConfig and calls `propose` once per step for the
whole batch: per row the tokens sampled last step, the row's token count without speculative
tokens, and the token-id table of the batch. It returns a linear draft per row (vLLM v1
verifies trees only for EAGLE), so the proposer takes from each draft tree the path with the
most expected accepted tokens (the sum of the nodes' path scores) up to vLLM's draft length.

vLLM tells the proposer nothing of request ids, so sequences are tracked by content: a row
continues the sequence the proposer last saw in it when the row's tokens still start with that
sequence's tokens (only the new tokens go to the drafter); otherwise the row holds another
request and a new drafter sequence starts with its full context (the old one is ended). The
drafter's state depends on the tokens alone, so a wrong guess can never give a wrong draft.

With `redis_url` set, the proposer also feeds the live datastore: every sequence it saw end
(its row taken by another request, the batch shrunk, or no step for `idle_s` seconds: vLLM steps
without pause while any request runs) is published once, prompt and answer with vLLM's
tokenizer's fingerprint, to the same Redis stream the engine's conversations go to, through the
same never-blocking publisher. The prompt/answer split is where the row's first sampled token
appeared; the answer is cut after its first EOS, and may run up to one verification step past a
length limit (vLLM's token table holds every accepted token; the reply is cut at max_tokens).
So every vLLM replica both drafts from and feeds the shared datastore.

vLLM must never stall or fail because of the drafter: each call has a deadline, and a failed
call gives the step no drafts (the rows restart on the next call). Nothing here imports vLLM or
is CPU-specific: the same class serves vLLM on GPUs.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import AutoTokenizer

from sssd.common.config.flags import env_values, field_kind, flag_fields, option
from sssd.common.conversations.record import STREAM, Conversation
from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import DraftRequest, Proposer, SequenceNotFound
from sssd.common.model.tokenizer import tokenizer_fingerprint
from sssd.drafter.replicas import check_tokenizer, connect

logger = logging.getLogger(__name__)

ENV_PREFIX = "SSSD_VLLM_"
CONFIG_KEY = "sssd"  # vLLM's additional_config section


@dataclass(frozen=True)
class ProposerSettings:
    """Read from vLLM's additional_config["sssd"] ({"drafter": ..., "budget": ...}) and from the
    environment of vLLM's workers (SSSD_VLLM_<FIELD>); the config's values win."""

    drafter: str = option("", "the drafter service: host:port, h1:p1,h2:p2,... or "
                          "dns:///NAME:PORT (required)")
    budget: int = option(16, "draft-tree nodes asked per sequence (root included)")
    timeout_s: float = option(0.2, "past this a step goes without drafts")
    check_tokenizer: bool = option(True, "refuse a drafter whose datastore has another "
                                   "tokenizer")
    # vLLM verifies a linear draft whole, so a token unlikely to be accepted costs verification
    # work for nothing. 0.2 measured best on mt_bench at b = 1 (vLLM CPU, SmolLM2-135M: 1.40x
    # over no speculation against 0.91x at 0 and 1.11x at 0.4; bench/vllm_peers.py --min-score).
    min_score: float = option(0.2, "draft only tokens whose path score (the drafter's estimate "
                              "of their chance of acceptance) is at least this")
    # The live datastore (see the module docstring); the password comes from
    # SSSD_REDIS_PASSWORD_FILE or SSSD_REDIS_PASSWORD, as for every publisher.
    redis_url: str = option("", "publish every finished conversation to this Redis stream's "
                            "server (the live datastore); empty: not published")
    stream: str = option(STREAM, "the Redis stream of completed conversations")
    spool_dir: str = option("", "where conversations wait while Redis is down; empty: a "
                            "temporary directory per worker")
    # Longer than any step can take (a step slower than this would end its rows early and
    # publish them in two parts); it only delays the last conversations before a quiet spell.
    idle_s: float = option(30.0, "after this long without a step every row has ended (and is "
                           "published)")

    def __post_init__(self) -> None:
        if not self.drafter:
            raise ValueError(f"no drafter address: set additional_config[\"{CONFIG_KEY}\"]"
                             f"[\"drafter\"] or {ENV_PREFIX}DRAFTER to the drafter service's "
                             "host:port")
        if self.budget < 2:
            raise ValueError(f"budget ({ENV_PREFIX}BUDGET) must be >= 2, got {self.budget}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s ({ENV_PREFIX}TIMEOUT_S) must be > 0, got "
                             f"{self.timeout_s}")
        if self.idle_s <= 0:
            raise ValueError(f"idle_s ({ENV_PREFIX}IDLE_S) must be > 0, got {self.idle_s}")
        if not 0 <= self.min_score <= 1:
            raise ValueError(f"min_score ({ENV_PREFIX}MIN_SCORE) must be in [0, 1], got "
                             f"{self.min_score}")

    @classmethod
    def from_config(cls, vllm_config: Any,
                    environ: dict[str, str] | None = None) -> "ProposerSettings":
        """The environment's settings, overridden by additional_config["sssd"] where present."""
        values = env_values(cls, ENV_PREFIX, environ)
        extra = getattr(vllm_config, "additional_config", None)
        section = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
        if section is None:
            return cls(**values)
        where = f'additional_config["{CONFIG_KEY}"]'
        if not isinstance(section, dict):
            raise ValueError(f"{where} must be a dict, got {type(section).__name__}")
        kinds = {f.name: field_kind(f) for f in flag_fields(cls)}
        unknown = sorted(set(section) - set(kinds))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(kinds)}")
        for name, value in section.items():
            kind = kinds[name]
            exact = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
            widened = kind is float and isinstance(value, int) and not isinstance(value, bool)
            if not (exact or widened):
                raise ValueError(f'{where}["{name}"]={value!r}: not a {kind.__name__}')
        return cls(**(values | section))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "ProposerSettings":
        return cls(**env_values(cls, ENV_PREFIX, environ))


@dataclass
class _Row:
    seq_id: str
    # [num_tokens] what the drafter holds for this sequence; None: its start is not sent yet
    tokens: np.ndarray | None
    # Tokens before the first one the row sampled: its prompt (None until it sampled one).
    prompt_len: int | None = None
    restart: bool = False  # the drafter lost it (or a call failed): send it whole again


def best_path(tree: DraftTree, max_len: int, min_score: float = 0.0) -> list[int]:
    """The root-to-node path of at most `max_len` drafts with the largest sum of path scores
    (the expected number of accepted tokens when each score is the chance its prefix is
    accepted), through nodes scored `min_score` or more only (a node's score never exceeds its
    parent's, so the path stops where the chance of acceptance falls below it); without scores,
    the deepest path of first children."""
    num_nodes = tree.num_nodes
    if num_nodes <= 1 or max_len <= 0:
        return []
    parents = tree.parents
    depth = np.zeros(num_nodes, dtype=np.int64)  # [num_nodes]
    value = np.zeros(num_nodes, dtype=np.float64)  # [num_nodes]
    scores = tree.probs if tree.probs is not None else np.ones(num_nodes, dtype=np.float32)
    for node in range(1, num_nodes):  # parents precede their children
        depth[node] = depth[parents[node]] + 1
        value[node] = value[parents[node]] + float(scores[node])
    eligible = (depth >= 1) & (depth <= max_len)
    if tree.probs is not None and min_score > 0:
        eligible &= scores >= min_score
    eligible = np.nonzero(eligible)[0]
    if len(eligible) == 0:
        return []
    # Ties go to the earlier node: the drafter orders nodes best first.
    node = int(eligible[np.argmax(value[eligible])])
    path = []
    while node > 0:
        path.append(int(tree.token_ids[node]))
        node = int(parents[node])
    return path[::-1]


class VllmDrafterProposer:
    """vLLM's custom proposer over the SSSD drafter service; see the module docstring."""

    def __init__(self, vllm_config: Any, drafter: Proposer | None = None,
                 settings: ProposerSettings | None = None,
                 fingerprint: str | None = None) -> None:
        """`vllm_config`: vLLM's VllmConfig (its speculative_config gives the draft length);
        `drafter`/`settings`/`fingerprint` (of the tokenizer): for tests, else the environment
        and vLLM's model decide."""
        self.settings = settings or ProposerSettings.from_config(vllm_config)
        self.num_speculative_tokens = int(
            vllm_config.speculative_config.num_speculative_tokens)
        # A draft token outside the model's vocabulary would crash vLLM's engine (an index out
        # of bounds in its embedding), so drafts are cut before one; see `_in_vocabulary`.
        model_config = getattr(vllm_config, "model_config", None)
        self.vocab_size = int(model_config.get_vocab_size()) \
            if hasattr(model_config, "get_vocab_size") else None
        self.num_foreign_drafts = 0
        if drafter is None:
            drafter = connect(self.settings.drafter, timeout_s=self.settings.timeout_s)
            if self.settings.check_tokenizer:
                _check_tokenizer(drafter, vllm_config, self.settings.drafter)
        self.drafter = drafter
        self._rows: list[_Row | None] = []
        self._prefix = secrets.token_hex(4)  # sequence ids unique per worker
        self._ids = itertools.count()
        self.num_calls = 0
        self.num_failures = 0
        self.num_published = 0
        # propose (vLLM's thread) and the idle watcher (ours) take turns on the rows.
        self._lock = threading.Lock()
        self._last_call = time.monotonic()
        self.publisher = None
        if self.settings.redis_url:
            self._start_publishing(vllm_config, fingerprint)

    def _start_publishing(self, vllm_config: Any, fingerprint: str | None) -> None:
        # Imported here: only a proposer that publishes needs Redis.
        from sssd.common.conversations.publisher import ConversationPublisher
        from sssd.common.conversations.redis_server import configured_password

        self.eos_token_ids: set[int] = set()
        if fingerprint is None:
            tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
            fingerprint = tokenizer_fingerprint(tokenizer)
            if tokenizer.eos_token_id is not None:
                self.eos_token_ids.add(int(tokenizer.eos_token_id))
        self.fingerprint = fingerprint
        spool = self.settings.spool_dir or tempfile.mkdtemp(prefix="sssd-vllm-spool-")
        self.publisher = ConversationPublisher(self.settings.redis_url, spool,
                                               stream=self.settings.stream,
                                               password=configured_password())
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch_idle, name="sssd-idle-rows",
                                         daemon=True)
        self._watcher.start()

    def _watch_idle(self) -> None:
        """Ends (and publishes) every row once vLLM has made no step for idle_s seconds."""
        period = min(0.5, self.settings.idle_s / 2)
        while not self._stopping.wait(period):
            with self._lock:
                if self._rows and time.monotonic() - self._last_call >= self.settings.idle_s:
                    self._end_all()

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's CPU runner asks every drafter to load a model; this one has none."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """`token_ids_cpu`: [max_num_reqs, max_model_len] the batch's tokens by row;
        `num_tokens_no_spec`: [max_num_reqs] each row's count without speculative tokens.
        Returns one draft (a token list, possibly empty) per row of `sampled_token_ids`."""
        with self._lock:
            self._last_call = time.monotonic()
            return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)

    def _propose(self, sampled_token_ids: Sequence[Sequence[int]],
                 num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray) -> list[list[int]]:
        num_rows = len(sampled_token_ids)
        self.num_calls += 1
        contexts = [token_ids_cpu[row, :int(num_tokens_no_spec[row])] for row in range(num_rows)]
        self._rows = self._match(contexts)
        try:
            try:
                trees = self.drafter.propose(self._requests(contexts))
            except SequenceNotFound as missing:  # the drafter restarted or a replica left
                lost = set(missing.seq_ids)
                for state in self._rows:
                    if state is not None and state.seq_id in lost:
                        state.restart = True
                trees = self.drafter.propose(self._requests(contexts))
        except Exception as exc:  # noqa: BLE001 - vLLM goes on without drafts
            self.num_failures += 1
            logger.warning("drafter call failed (%s); this step has no drafts", exc)
            for state in self._rows:  # what the drafter holds is unknown: start them again
                if state is not None:
                    state.restart = True
            return [[] for _ in range(num_rows)]
        for row, context in enumerate(contexts):
            state = self._rows[row]
            assert state is not None
            state.tokens = context.copy()
            sampled = len(sampled_token_ids[row])
            if state.prompt_len is None and sampled:  # its first sampled token is here
                state.prompt_len = len(context) - sampled
        return [self._in_vocabulary(best_path(tree, self.num_speculative_tokens,
                                              self.settings.min_score))
                for tree in trees]

    def _in_vocabulary(self, draft: list[int]) -> list[int]:
        """The draft up to its first token id outside the model's vocabulary (a drafter whose
        datastore has another tokenizer, which `_check_tokenizer` refuses at start when the
        drafter reports it); warned about once."""
        if self.vocab_size is None:
            return draft
        for index, token in enumerate(draft):
            if not 0 <= token < self.vocab_size:
                if not self.num_foreign_drafts:
                    logger.warning("the drafter drafted token id %d, outside the model's "
                                   "vocabulary of %d: drafts are cut there (is its datastore "
                                   "built with another tokenizer?)", token, self.vocab_size)
                self.num_foreign_drafts += 1
                return draft[:index]
        return draft

    def close(self) -> None:
        with self._lock:
            self._end_all()
        if self.publisher is not None:
            self._stopping.set()
            self._watcher.join(5)
            self.publisher.close()
        self.drafter.close()

    def _match(self, contexts: list[np.ndarray]) -> list[_Row | None]:
        """Each row's sequence: the one the row held last call if its tokens still start with
        that sequence's, else any other of last call's sequences that they start with (vLLM
        moves rows when a request leaves the batch), else None (a new request). Sequences no
        row continues have ended: they are published and ended in the drafter."""
        previous = self._rows
        rows: list[_Row | None] = [None] * len(contexts)
        claimed: set[str] = set()
        for row, context in enumerate(contexts):
            state = previous[row] if row < len(previous) else None
            # A start that was never sent (lost with a failed call) stays with its row.
            if state is not None and (state.tokens is None or _continues(state, context)):
                rows[row] = state
                claimed.add(state.seq_id)
        for row, context in enumerate(contexts):
            if rows[row] is not None:
                continue
            for state in previous:
                if state is not None and state.seq_id not in claimed and \
                        state.tokens is not None and _continues(state, context):
                    rows[row] = state
                    claimed.add(state.seq_id)
                    break
        self._end([state for state in previous
                   if state is not None and state.seq_id not in claimed])
        return rows

    def _requests(self, contexts: list[np.ndarray]) -> list[DraftRequest]:
        """One request per row: the new tokens of a continuing sequence, or a new sequence."""
        requests = []
        replaced = []
        for row, context in enumerate(contexts):
            state = self._rows[row]
            if state is None:
                state = self._rows[row] = _Row(self._new_id(), None)
            if state.restart:  # under a new id: the old one may be held where it was lost
                replaced.append(state.seq_id)
                state.seq_id, state.restart = self._new_id(), False
                state.tokens = None
            if state.tokens is None:  # a start to send (again)
                requests.append(DraftRequest(state.seq_id, context.astype(np.int32),
                                             self.settings.budget, is_start=True))
            else:
                requests.append(DraftRequest(state.seq_id,
                                             context[len(state.tokens):].astype(np.int32),
                                             self.settings.budget))
        if replaced:
            self._end_ids(replaced)
        return requests

    def _new_id(self) -> str:
        return f"vllm-{self._prefix}-{next(self._ids)}"

    def _end_all(self) -> None:
        """Every row's sequence has ended (vLLM idle, or the proposer closes)."""
        self._end([state for state in self._rows if state is not None])
        self._rows.clear()

    def _end(self, states: list[_Row]) -> None:
        """Sequences that ended: published, then ended in the drafter."""
        for state in states:
            self._publish(state)
        self._end_ids([state.seq_id for state in states])

    def _publish(self, state: _Row) -> None:
        """A sequence that ended, to the live datastore (once: its row state is dropped after).
        A row that never sampled a token (a prefill cut short) has no answer to publish."""
        if self.publisher is None or state.tokens is None or state.prompt_len is None:
            return
        tokens = state.tokens.tolist()
        prompt, answer = tokens[:state.prompt_len], tokens[state.prompt_len:]
        end = next((i + 1 for i, t in enumerate(answer) if t in self.eos_token_ids), None)
        if end is not None:
            answer = answer[:end]
        if not answer:
            return
        self.publisher.publish(Conversation(prompt, answer, self.fingerprint,
                                            "stop" if end is not None else "length",
                                            uid=state.seq_id))
        self.num_published += 1

    def _end_ids(self, seq_ids: list[str]) -> None:
        if not seq_ids:
            return
        try:
            self.drafter.end(seq_ids)
        except Exception as exc:  # noqa: BLE001 - a drafter that is gone holds nothing
            logger.warning("ending %d sequences in the drafter failed: %s", len(seq_ids), exc)


def _continues(state: _Row, context: np.ndarray) -> bool:
    """Whether `context` starts with every token the drafter holds for `state`."""
    held = len(state.tokens)
    return len(context) >= held and np.array_equal(context[:held], state.tokens)


def _check_tokenizer(drafter: Any, vllm_config: Any, target: str) -> None:
    """Refuses a drafter whose datastore was built with another tokenizer than vLLM's model."""
    tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
    check_tokenizer(drafter, target, tokenizer_fingerprint(tokenizer))
