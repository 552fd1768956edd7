"""Training the EAGLE-3 draft, one concern a module; read in this order: ``loop`` (:func:`train_drafter`, the
entry stages/train_drafter.py calls: set-up, epochs, optimizer step, end of epoch, summary), ``prepare`` (the
set-up's steps: feature index and split, draft config and vocabulary, the seeded draft, the top-1-in-vocabulary
table), ``packing`` (train / held-out split, samples packed into rows per epoch, a row collated into a Batch),
``stream`` (the data thread reading rows ahead and refusing non-finite features), ``step`` (one batch's soft
targets and TTT unroll, AdamW and the warmup + cosine schedule), ``ttt`` (the training-time-test unroll and its
loss), ``distributed`` (torchrun launch and ranks, DDP / FSDP2 sharding, device, autocast, RNG state),
``checkpoint`` (the loop's State and the resumable ``<scratch>/<run key>/`` saves) and ``safe_tree`` (their file
format: safetensors + JSON, read without running code), ``curves`` (step sums, dvclive curves, compile counters),
``evaluation`` (held-out accuracy per TTT step and τ_sim); then ``online`` (features computed by the frozen
target inside the loop, for a tokens store) and ``graphed`` (the whole step replayed as a CUDA graph).
"""
