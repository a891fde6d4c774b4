import sys

from c2jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
