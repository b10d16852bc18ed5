from kamado.attention.backend import AttentionBackend, SeqChunk, make_backend

__all__ = ["AttentionBackend", "SeqChunk", "make_backend"]
