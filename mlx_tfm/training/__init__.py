"""Training: pre-training from scratch and LoRA / DoRA / full fine-tuning.

The pieces: ``trainer`` (TrainingArgs, the loss, evaluate, the compiled loop), ``data``
(datasets and batches), ``lora`` (adapter surgery), ``schedule``, ``checkpoints``,
``plots``; ``pretrain`` and ``finetune`` are the two commands built from them.
"""
