"""Generated gRPC stubs (see specpair/proto_gen.py)."""
