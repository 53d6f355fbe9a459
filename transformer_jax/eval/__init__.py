"""Evaluation: decoding (KV cache, greedy, beam, sampling), metrics, evaluate, translate.

Above the training layer: restoring a workdir's checkpoints reads `train.checkpoint`.
"""
