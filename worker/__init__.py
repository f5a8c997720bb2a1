"""The worker process: owns the KV pools and the math, decides nothing (entry point: `python -m pagedkv.worker`)."""
