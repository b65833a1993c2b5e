"""The controller's process: target links, the policy loop per target, memory, the ops API."""
