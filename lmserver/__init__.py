"""lmserver: an asyncio remote KV-cache server speaking LMCache's lm:// protocol."""

__version__ = "0.1.0"
