"""The `specpair` command (`main.py`) and what it runs: serve options, `up`, the SDK's commands."""
