"""Loading models (Hub id, local directory, .gguf, the offline default) and finding their
matmuls."""
