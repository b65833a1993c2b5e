"""The target's OpenAI-compatible HTTP door: routes, guards, OpenAI bodies in and out."""
