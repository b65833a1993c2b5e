"""A client's request from either door to its stream: decode, validate, submit, detokenize."""
