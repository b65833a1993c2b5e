"""Generated gRPC stubs (see specpair/rpc/proto_gen.py)."""
