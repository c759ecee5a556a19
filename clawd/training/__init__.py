"""Training side of clawd: MLX LoRA on the served model's weights (trainer child process only).

Importing this package is cheap; the modules below import mlx, mlx_lm, gguf and llama_cpp.
What the trainer can train (MODEL_TYPES, why_untrainable) is read from model headers by
clawd/modelfile.py, so the daemon can ask without touching this package.
"""
