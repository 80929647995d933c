"""The ground floor: shared records, the engine and sandbox protocols, the store and its
migrations, tokenizer loaders, child processes, logging and statistics. Imports nothing of ours."""
