"""The checkpoint error type of c2jax.hf."""


class CheckpointError(ValueError):
    """A checkpoint is missing tensors, has mis-shaped ones or an unsupported layout or format."""
