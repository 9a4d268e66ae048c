"""The algorithms: advantage estimators, policy losses and their one aggregation, verifiable
rewards and reward shaping, learning-rate schedules, rollout correction (truncated IS weights),
the training-inference mismatch and dynamic vocabulary pruning. Pure functions and registries over
numpy, polars or torch tensors: no file, no config loading, no stage."""
