"""A training run: the trainer and its update, what a step collects, checkpoints, signals,
metrics, plots, trackers, torchrun and FSDP."""
