"""Data: prompt rows and files, `Sample` and `TrainBatch`, the data plane's column names and row codecs,
media processing for multimodal rows, the toy data sets, chat-template variables (`chat_template`) and
the `<think>` reasoning parser of model outputs (`reasoning`).

Layer: data (ARCHITECTURE.md), near the bottom. May import models and utils only.
"""
