"""Speculative decoding: draft proposers, the adaptive controller, and the speculator that
plans each step's drafts (verification itself happens in the engine's model runner)."""
