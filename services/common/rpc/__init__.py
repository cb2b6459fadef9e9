"""gRPC plumbing shared by the services and their clients."""
