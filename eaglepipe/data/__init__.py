"""What is trained on: prompts, the chat template and loss mask, extraction, the feature store."""
