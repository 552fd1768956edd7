"""The EAGLE-3 draft model, its vocabulary (d2t/t2d), its RoPE and the target head it is trained against."""
