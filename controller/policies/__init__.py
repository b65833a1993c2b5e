"""The speculation policies, pure: rounds in, a tier out; no grpc, no service, no SDK."""
