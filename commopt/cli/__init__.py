"""The ``commopt`` command line: ``tune`` and ``bench`` (see :mod:`commopt.cli.main`)."""

__all__: list[str] = []
