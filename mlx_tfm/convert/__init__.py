"""Checkpoint importers: Hugging Face (local or hub), llama2.c, GGUF and mlx-community
folders become MLX folders that ``mlx_tfm.load`` runs. Run as ``mlx-tfm convert`` or
``python -m mlx_tfm.convert``."""
