"""Tensor parallelism of the target: its ranks (`ranks.py`), their lockstep (`lockstep.py`),
and the target worker over them (`build.py`); the sharded model is `models/parallel.py`."""
