"""LoRA adapters: strict loading of PEFT and mlx-lm adapters (kipp.lora.adapter) and the
unmerged low-rank term W x + s * B (A x) applied per row (kipp.lora.apply)."""
