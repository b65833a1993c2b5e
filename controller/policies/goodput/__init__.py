"""The goodput kind: the tier with the most expected tokens per second (`policy.py`)."""
