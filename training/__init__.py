"""Reproducible training of specpair's shipped model pair (target, draft LM, EAGLE head)."""
