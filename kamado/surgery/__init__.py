"""Load-time model surgery: named steps that change how the model computes so it fits the
machine (fused projections, compressed weights, GGUF weights kept as stored, the KV cache's
dtype), each reporting the memory it saved. Chosen by `--surgery a,b,c`; see registry.py
for the names and pipeline.py for how steps run."""
