"""Subcommands of ``dspark-core`` (see :mod:`dspark_core.cli`)."""
