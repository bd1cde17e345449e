"""Storage tiers behind the Store: memory first, then disk and remote tiers."""
