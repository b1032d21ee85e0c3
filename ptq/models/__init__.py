"""Loading models (Hub id, local directory, .gguf, the offline default), finding their matmuls."""
