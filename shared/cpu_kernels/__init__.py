"""Hand-written C++ CPU kernels, built on first use with the system's C++ compiler and loaded with ctypes
(shared.cpu_kernels.library). Each one has a PyTorch path it replaces, which stays the fallback."""
