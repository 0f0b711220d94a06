"""Speculative decoding: proposers that guess the next few tokens and exact verification against the target.

``ngram`` is pure Python (no torch); ``rejection`` holds the batched verifier. Import the submodules
directly, so that importing the n-gram proposer does not pull in torch.
"""
