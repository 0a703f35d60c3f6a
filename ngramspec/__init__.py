"""ngramspec: adaptive n-gram speculative decoding (numba suffix-trie drafts, a cost-aware controller)."""
from ngramspec.cache import Draft, DraftBatch, NgramCache

__all__ = ["NgramCache", "Draft", "DraftBatch"]
__version__ = "0.1.0"
