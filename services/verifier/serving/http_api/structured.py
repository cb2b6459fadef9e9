"""Structured output in the HTTP API: OpenAI's response_format and vLLM's guided_* fields and
structured_outputs object, each parsed into the engine's Grammar; at most one per request."""

from __future__ import annotations

import json

from sssd.verifier.engine.request import Grammar, InvalidRequest
from sssd.verifier.serving.http_api.errors import ApiError

# vLLM's structured-output fields: its older guided_* names and its structured_outputs object.
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex",
                 "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                           "grammar": "grammar", "json_object": "json_object"}


def structured_output(body: dict) -> tuple[Grammar | None, str | None]:
    """The request's grammar (None: free text) and the field it came in: OpenAI's
    response_format, or one of vLLM's guided_* fields or its structured_outputs object; at most
    one of them. Raises ApiError naming the field."""
    given = [name for name in ("response_format", *GUIDED_FIELDS, "structured_outputs")
             if body.get(name) is not None]
    if len(given) > 1:
        raise ApiError(400, f"{given[1]}: only one of {', '.join(given)} may be given",
                       given[1])
    if not given:
        return None, None
    name = given[0]
    value = body[name]
    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "text" and set(value) == {"type"}:
            return None, None
        if kind == "json_object" and set(value) == {"type"}:
            return _grammar(name, "json_object")
        spec = value.get("json_schema") if isinstance(value, dict) else None
        if kind != "json_schema" or set(value) != {"type", "json_schema"} or \
                not isinstance(spec, dict) or not set(spec) <= {"name", "description",
                                                                "schema", "strict"}:
            raise ApiError(400, "response_format: {\"type\": \"text\"}, {\"type\": "
                           "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                           "{\"name\": ..., \"schema\": {JSON schema}}}", name)
        if spec.get("schema") is None:
            return _grammar(name, "json_object")
        return _grammar(name, "json_schema", _schema_text(spec["schema"], name))
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise ApiError(400, "structured_outputs: an object with one of "
                           f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}", name)
        keys = [k for k, v in value.items() if v is not None]
        if len(keys) != 1 or keys[0] not in STRUCTURED_OUTPUTS_KEYS:
            raise ApiError(400, "structured_outputs: exactly one of "
                           f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}", name)
        kind, value = STRUCTURED_OUTPUTS_KEYS[keys[0]], value[keys[0]]
        name = f"structured_outputs.{keys[0]}"
    else:
        kind = GUIDED_FIELDS[name]
    if kind == "json_object":
        return _grammar(name, "json_object")
    if kind == "json_schema":
        return _grammar(name, "json_schema", _schema_text(value, name))
    if kind == "choice":
        if not (isinstance(value, list) and all(isinstance(c, str) for c in value)):
            raise ApiError(400, f"{name}: a list of strings", name)
        return _grammar(name, "choice", choices=tuple(value))
    if not isinstance(value, str):
        raise ApiError(400, f"{name}: a string", name)
    return _grammar(name, kind, value)


def _grammar(name: str, kind: str, spec: str = "", choices: tuple[str, ...] = ()
             ) -> tuple[Grammar, str]:
    """The Grammar, and the field it came in; an invalid one is a 400 naming that field."""
    try:
        return Grammar(kind, spec, choices), name
    except InvalidRequest as exc:
        reason = str(exc).split(":", 1)[-1].strip()
        raise ApiError(400, f"{name}: {reason}", name) from None


def _schema_text(schema: object, name: str) -> str:
    """A JSON schema given as an object or as its JSON text, as text."""
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, (dict, bool)):
        raise ApiError(400, f"{name}: a JSON schema (an object)", name)
    return json.dumps(schema)
