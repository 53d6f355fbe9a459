"""The special token ids: the tokenizer writes them, the model and the decoders read them."""

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
# The masked-language-model's <mask> piece: the first user-defined piece of an encoder-only
# model's tokenizer (data/tokenizer.py).
MASK_ID, MASK_PIECE = 4, "<mask>"
