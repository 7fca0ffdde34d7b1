"""`hybridserve bench`: load generators for any OpenAI-compatible server (`serve`)."""
