"""Training side of clawd: MLX LoRA on the served model's weights (trainer child process only).

Importing this package is cheap; the modules below import mlx, mlx_lm, gguf and llama_cpp.
"""
