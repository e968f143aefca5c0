"""Everything checkpoint: directories and checks before start, files and their checksums, the training state, optimizer state, fine-tuning starts, Hugging Face conversion."""
