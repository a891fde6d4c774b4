"""`python -m c2jax.ops`: every op, its implementations, its auto order per platform and the
paths it takes across a mesh around an implementation."""
from c2jax.ops import load_all


def main() -> None:
    """Print the registries."""
    for name, op in sorted(load_all().items()):
        print(f"{name}:")
        for platform, order in op.auto.items():
            print(f"  auto on {platform}: {' > '.join(order)}")
        for impl in op.impls.values():
            print(f"  {impl.name:28s} {impl.doc.strip().splitlines()[0] if impl.doc.strip() else ''}")
        for path, doc in op.paths.items():
            print(f"  {path + '(...)':28s} across a mesh: {doc}")


if __name__ == "__main__":
    main()
