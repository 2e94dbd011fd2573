"""The async trainer: learns from molt-proxy's trajectory stream and refreshes vLLM."""
