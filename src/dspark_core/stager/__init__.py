"""The Stager's Python contract: what it is configured with, takes, returns and writes.

Its configuration (``config``), the core's tables and limits (``core_tables``),
the binding's argument conversions (``_args``), its answers (``stage_plan``,
``device_step``), the snapshot format, how a protocol mismatch is logged, and
how a Stager is pickled. The Stager itself is the C++ core's, bound in
``dspark_core._ext._stager`` and exported as :class:`dspark_core.Stager`.

Nothing is imported here: the binding imports these modules while it loads.
"""
