"""Export: a LoRA checkpoint merged into a plain model (tensor by tensor) and checked; GGUF
files written by llama.cpp's own tools, with an Ollama Modelfile. The package is also the
Python API's callable swiftlite.export(...) (see swiftlite/__init__.py)."""
