"""gRPC plumbing the services share: channels, servers, interceptors, health, metrics, the wire."""
