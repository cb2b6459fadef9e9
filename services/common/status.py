"""The NOT_FOUND details of the drafter and speculator protocols, written by each service and
read by its client.

drafter.proto and speculator.proto: the details of NOT_FOUND are the literal prefix
`unknown seq_ids ` followed by a JSON array of every unknown id of the request, so the caller can
re-send exactly those with their full context. Kept apart from both ends so a client does not
import its server.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

UNKNOWN_IDS_PREFIX = "unknown seq_ids "


def unknown_ids_details(seq_ids: Sequence[str]) -> str:
    return (
        f"{UNKNOWN_IDS_PREFIX}{json.dumps(list(seq_ids))}: never started, ended or evicted; "
        "re-send them with is_start=true and the full context"
    )


def parse_unknown_ids(details: str) -> list[str]:
    """Inverse of `unknown_ids_details`; [] if `details` does not have that form."""
    if not details.startswith(UNKNOWN_IDS_PREFIX):
        return []
    try:
        ids, _ = json.JSONDecoder().raw_decode(details, len(UNKNOWN_IDS_PREFIX))
    except json.JSONDecodeError:
        return []
    return [str(seq_id) for seq_id in ids] if isinstance(ids, list) else []
