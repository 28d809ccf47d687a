"""The prefix store's Python side: its answers, keys, block format and row owners.

What a lookup or publish returns (``hit``), the binding's key and block
conversions (``keys``), the exported block's format (``block_format``), the
rules every owner of an external-row store's rows keeps (``table_owner``) and
the host owner (``host_table``; the device one is
:mod:`dspark_core.cuda.prefix_table`). The store itself is the C++ core's,
bound in ``dspark_core._ext`` and exported as :class:`dspark_core.PrefixStore`.

Nothing is imported here: the binding imports ``hit`` and ``keys`` while it loads.
"""
