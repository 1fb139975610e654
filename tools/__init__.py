"""Command-line tools: tokenizer, data preprocessing, the paper's tables, dry runs."""
