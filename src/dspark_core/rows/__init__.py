"""External rows: who owns an external-row Stager's rows and how they move.

The rules every owner keeps (``ring_owner``), the host owner (``host_ring``;
the device one is :mod:`dspark_core.cuda.device_ring`), the table changes a
Stager hands its owner (``slot_moves``), and the bfloat16 dtype rows are
read in (``_bf16``).

Nothing is imported here: the binding imports ``slot_moves`` while it loads.
"""
