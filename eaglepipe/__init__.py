"""eaglepipe: train EAGLE-3 draft models whose serving features are the features they were trained on.

Inside the project a layer is named by its residual-stream boundary index k (h[k]): 0 = token
embeddings, k = input of decoder layer k, N = output of the last layer before the final norm.
Engine-specific meanings of layer ids live only in :mod:`eaglepipe.contract.convention`.
"""

__version__ = "0.1.0"
