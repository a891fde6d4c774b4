"""Training: optimizer, step (loss, grad accumulation, bias update), checkpoints, metrics, loop."""
