"""sssd.indexer: finished conversations from the Redis stream into live datastore shards.

    indexer.py     the loop: read, buffer, build when due, acknowledge, merge in the background
    consumer.py    the consumer group reader, dead letters, trimming only what is indexed
    builder.py     the live datastore's directory: new shards, retention, crash clean-up
    compaction.py  size-tiered merges of the shards
    service.py     `sssd-indexer run` and `sssd-indexer offline`
"""
