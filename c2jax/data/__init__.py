"""Data: corpus sources (corpus), tokenizer, grain pipelines (pipeline), codebase perplexity
windows (codebase), and the `cfg.data` config section (config)."""
