"""The special token ids: the tokenizer writes them, the model and the decoders read them."""

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
