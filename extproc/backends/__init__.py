"""Per-backend and per-endpoint live state: slots, KV, the wait queue, engine scraping."""
