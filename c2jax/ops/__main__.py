"""`python -m c2jax.ops`: every op, its implementations and its auto order per platform."""
from c2jax.ops import load_all


def main() -> None:
    """Print the registries."""
    for name, op in sorted(load_all().items()):
        print(f"{name}:")
        for platform, order in op.auto.items():
            print(f"  auto on {platform}: {' > '.join(order)}")
        for impl in op.impls.values():
            print(f"  {impl.name:24s} {impl.doc.strip().splitlines()[0] if impl.doc.strip() else ''}")


if __name__ == "__main__":
    main()
