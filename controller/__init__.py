"""The controller: `policies/` (pure: the tier each target runs) and `service/` (the process:
per-target round watchers, the ops API).

Importing the package imports nothing else, so `controller.policies` needs no grpc.
"""
