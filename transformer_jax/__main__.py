"""`python -m transformer_jax --config=... --mode=...`: the command line (`cli.py`)."""

from transformer_jax.cli import main

main()
