"""CUDA graphs of the round's stages, per tier and batch bucket (GPU only; see `capture.py`)."""
