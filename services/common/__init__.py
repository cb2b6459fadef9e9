"""sssd.common: the code more than one service needs, one small package per role.

    drafting/       the drafting contract: Proposer, DraftRequest, DraftTree, the source router
    rpc/            gRPC plumbing: the error <-> status table, TLS, ports, targets, health probe
    model/          the model stack: model and tokenizer loading, model files, the slot KV cache
    config/         configuration: flags from config dataclasses, logging set-up, secret files
    data/           prompt and corpus readers (MT-Bench, ShareGPT, chat templates)
    conversations/  the completed-conversation record, its Redis stream and the publisher
"""
