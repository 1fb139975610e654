"""Training: config and command line, learning-rate schedule, metrics and the training loop."""
