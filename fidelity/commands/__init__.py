"""Subcommands of the `fidelity` CLI, one module each (see fidelity/cli.py)."""
