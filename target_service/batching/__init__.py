"""Continuous batching: the scheduler, its served requests, tiers, round accounts and load."""
