"""Data: prompt rows and files, `Sample` and `TrainBatch`, the data plane's column names and row codecs,
media processing for multimodal rows, and the toy data sets.

Layer: data (ARCHITECTURE.md), near the bottom. May import models and utils only.
"""
