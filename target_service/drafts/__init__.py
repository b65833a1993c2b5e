"""The target's draft replicas: a Round stream each, the pool, merged answers, deadlines."""
