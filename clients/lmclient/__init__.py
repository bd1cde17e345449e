"""lmclient: sync and async clients for lmserver and LMCache lm:// servers."""
