"""Training: losses, state + optimizer + schedules, the step, parallelism, checkpoints, the loop
and its periodic actions, the metric logger."""
