"""The command line from a checkout: `python launch.py --config=... --mode=...`.

The same as the installed `transformer-jax` console script (`transformer_jax/cli.py`).
"""

from transformer_jax.cli import main

if __name__ == "__main__":
  main()
