"""Completed conversations on their way to the live datastore: the record, its Redis stream,
the publisher the serving side uses and the embedded Redis server."""
