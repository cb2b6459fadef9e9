"""The engine's one error for a client's mistake, shared by the request types (request.py,
grammar.py)."""


class InvalidRequest(ValueError):
    """A request field is out of range; the message names the field and what is allowed."""
