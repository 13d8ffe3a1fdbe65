"""The workshop: the built-in task world, its tiny model and fine-tuned start, and the sweeps."""
