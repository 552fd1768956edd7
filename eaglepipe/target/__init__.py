"""The target model: its config, data/target/ and TargetInfo, quantization, capture checks, tiny targets."""
