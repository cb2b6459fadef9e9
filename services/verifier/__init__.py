"""sssd.verifier: the target model (docs/services/verifier.md).

    engine/        pure compute: the engine step, the model runner, acceptance, the budget policy
    serving/       the loop, the gRPC frontend, Ray workers, metrics
    proposers.py   which drafting source each engine mode uses (the registry)
    factory.py     engines and budget policies from an EngineConfig
"""
