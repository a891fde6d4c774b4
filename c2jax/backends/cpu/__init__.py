"""XLA:CPU FFI kernels (C++ sources, their build, and Python wrappers): one backend of c2jax.ops."""
