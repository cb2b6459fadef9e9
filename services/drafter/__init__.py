"""sssd.drafter: the SSSD drafter (docs/services/drafter.md).

    core/          the C++ core, the module sssd._core
    drafter.py     `LocalDrafter`, the in-process drafter (a Proposer)
    watcher.py     the datastore's manifest, watched and swapped in live
    service.py     `sssd-drafter`, the gRPC service
    client.py      `RemoteDrafter`, one replica; replicas.py: `ReplicatedDrafter`, several
    reference.py   the algorithm in plain Python, for the property tests
    config.py      `DrafterConfig` and `DraftParams`
"""
