"""Storage: the memory tier, the buffer pool it draws from, the tier chain behind it (``tiers``)
and the ``Store``, the one facade the connections use.

Import map (one way): ``store`` -> ``chain``, ``memory`` -> ``pool``, and all of them ->
``tiers.base``; nothing here imports the connection, the server or the protocol codec's
framing (the memory tier copies small objects out through a ``memory.Reader`` the connection
hands in)."""
