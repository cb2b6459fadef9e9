"""sssd.datastore: the on-disk datastore format that the drafter reads and the indexer writes.

    shard.py     one immutable shard: token stream, suffix array, first-token index, metadata
    manifest.py  which shards are active, replaced atomically
    build.py     documents -> shards + manifest (`sssd-build-datastore`), hard-linked copies,
                 reading the documents back

Reading a datastore needs only numpy; building a shard's suffix array calls the C++ core
(`sssd._core`), imported on first use.
"""
