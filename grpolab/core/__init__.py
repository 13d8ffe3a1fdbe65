"""Pure tensor maths (advantages, losses and their registries); imports nothing else of grpolab."""
