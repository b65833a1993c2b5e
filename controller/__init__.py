"""The controller: adaptive tier policy, per-target round watchers and the ops API.

Importing the package imports nothing else, so `controller.policy` needs no grpc.
"""
