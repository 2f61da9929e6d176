"""Reading OpenAI request bodies and responses; OpenAI-shaped errors; the models list."""
