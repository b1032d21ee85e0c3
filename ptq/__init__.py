"""ptq: post-training quantization of Hugging Face causal LMs to FP8 E4M3, against int8 and bf16."""

__version__ = "0.1.0"
