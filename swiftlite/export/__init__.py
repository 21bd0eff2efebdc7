"""Export: a LoRA checkpoint merged into a plain model (tensor by tensor) and checked."""
