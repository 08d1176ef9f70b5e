"""The model's layers: norm, rope, linear (+ MLP), attention (GQA, MLA, paged), router, MoE."""
