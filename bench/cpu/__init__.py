"""The benches that run on the CPU, one module a mode of `python -m bench.cpu MODE`."""
