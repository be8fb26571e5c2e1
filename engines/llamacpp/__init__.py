"""The llama.cpp engine (llama-cpp-python): GGUF models on the CPU, concurrent requests in slots."""
