"""The model format: weight files, quantization, safetensors reading, conversion, checks."""
