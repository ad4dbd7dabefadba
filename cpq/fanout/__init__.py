"""CI fan-out: one suite over many nodes as shards, and one verdict back.

``shard`` computes each shard's share (pure), ``durations`` reads and writes the recorded
seconds it balances on, ``manifest`` and ``junit`` are each shard's result files, ``merge``
checks and combines them, ``plugin`` hooks it all into pytest and ``cli`` is ``cpq merge``.
"""
