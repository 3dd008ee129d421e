"""The torch backend: the forward step on any torch device (a CUDA GPU, or the CPU for
checking this path without one). Imports torch: reach it only when a torch device is asked for."""
