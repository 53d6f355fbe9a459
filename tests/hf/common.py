"""What the Hugging Face tests share (tests/hf/): tiny models of each architecture built by
`transformers` at random initialisation with tokenizers trained here (nothing downloaded), and
the comparisons of theirs with ours. Importing it skips a test file where the hf extra (torch,
transformers, tokenizers) is missing."""

import io
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import config as config_lib
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.eval.load import load_trained
from transformer_jax.model import make_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
spm = pytest.importorskip("sentencepiece")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = ["a small dog runs in the park", "two men are playing football on the grass",
         "ein kleiner Hund rennt im Park", "zwei Männer spielen Fußball auf dem Rasen",
         "a woman in a red coat waits for the bus while it rains"] * 20
TOLERANCE = 1e-4


def byte_level_bpe(texts, vocab_size=300):
  """GPT-2's kind of tokenizer: byte-level BPE with <|endoftext|>."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tokenizer


def wordpiece(texts, vocab_size=200):
  """BERT's kind of tokenizer: WordPiece, lower-cased, [CLS] text [SEP]."""
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
  tokenizer.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
  tokenizer.decoder = tokenizers.decoders.WordPiece()
  tokenizer.train_from_iterator(texts, tokenizers.trainers.WordPieceTrainer(
      vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
  cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
  tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
      single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
      special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
  return tokenizer


def randomize(model, seed=0, scale=0.3):
  """Every parameter drawn anew (norm scales and biases too, which init leaves at 1 and 0), so
  that a scale swapped with a bias or a transposed matrix cannot go unnoticed."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for parameter in model.parameters():
      parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
  return model.eval()


def save(model, tokenizer, directory, **special_tokens):
  model.save_pretrained(directory)
  transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer,
                                       **special_tokens).save_pretrained(directory)
  return str(directory)


def bert_dir(tmp_path_factory, head, name):
  tokenizer = wordpiece(TEXTS)
  config = transformers.BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=48,
                                   num_labels=3)
  torch.manual_seed(0)
  model = randomize(head(config), scale=0.2)
  return save(model, tokenizer, tmp_path_factory.mktemp(name), pad_token="[PAD]",
              unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def trained_from(workdir):
  return load_trained(config_lib.from_workdir(str(workdir)), str(workdir))


def random_batch(vocab_size, seed=0, lengths=(12, 7, 3), low=0):
  """Their ids `[3, 12]` (random, right-padded with 0) and the bool mask of real tokens."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(low, vocab_size, (len(lengths), max(lengths)))
  mask = np.arange(max(lengths))[None] < np.asarray(lengths)[:, None]
  return np.where(mask, ids, 0), mask


def their_logits(model, ids, mask):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask.astype(np.int64)))
  return out.logits.numpy()


def our_logits(trained, ids, mask):
  """Our logits in their vocabulary's order: `[batch, length, their vocab]` (or the classes)."""
  tokenizer = trained.tokenizer
  tokens = jnp.asarray(np.where(mask, tokenizer.our_ids[ids], 0), jnp.int32)
  model = make_model(trained.model_config.replace(deterministic=True))
  if trained.model_config.arch == "decoder_only":
    logits = model.apply({"params": trained.params}, tokens[:, :0], tokens)
  else:
    logits = model.apply({"params": trained.params}, tokens)
  logits = np.asarray(logits)
  return logits[:, 0] if trained.model_config.num_labels else logits[..., tokenizer.our_ids]


def assert_logits_match(trained, reference, ids, mask):
  """Asserts that our logits of the padded batch are the reference's (max |diff| <= TOLERANCE
  over the real tokens), and that theirs are not all small (the comparison has something to
  compare)."""
  expected = their_logits(reference, ids, mask)
  assert np.abs(our_logits(trained, ids, mask) - expected)[mask].max() <= TOLERANCE
  assert np.abs(expected).max() > 1.0


MULTI30K = os.path.join(ROOT, "..", "shared", "data", "multi30k")


def multi30k(split, language, count):
  with open(os.path.join(MULTI30K, f"{split}.{language}"), encoding="utf-8") as f:
    return [line.rstrip("\n") for _, line in zip(range(count), f)]


def our_workdir(config, tokenizer, workdir):
  """A workdir of our own at step 5 (config.json, the SentencePiece tokenizer, a checkpoint) whose
  parameters are a fresh init moved by random noise (norms and biases away from 1 and 0 too).
  Returns (the model config, the saved state)."""
  from transformer_jax.train import checkpoint
  from transformer_jax.train import state as state_lib
  model_config = config_lib.validate(config)
  optimizer = state_lib.make_optimizer(config.train, model_config.d_model)

  def noised_state():  # jitted: one compiled program, not one dispatch per operation
    state = state_lib.create_state(model_config, optimizer, seed=3)
    return state.replace(params=jax.tree.map(
        lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape),
        state.params))

  state = jax.jit(noised_state)()
  workdir.mkdir()
  (workdir / tokenizer_lib.FILENAME).write_bytes(tokenizer.model_proto)
  (workdir / "config.json").write_text(config.to_json_best_effort())
  manager = checkpoint.Manager(str(workdir), config, checkpoint.sha256(tokenizer.model_proto),
                               writable=True)
  manager.save(5, state)
  manager.wait()
  manager.close()
  return model_config, state


def ct2_greedy_equals_ours(generator, tokenizer, prompts, mask, ours, hf_ids, **options):
  """Asserts that CTranslate2's greedy continuation of each prompt (HF ids `prompts[row,
  :length]`) is ours (`ours`: our ids, read through `hf_ids`) up to our EOS, which CTranslate2
  drops. `options`: more generate_batch arguments. Returns how many tokens were compared."""
  compared = 0
  for row, length in enumerate(mask.sum(1)):
    tokens = tokenizer.convert_ids_to_tokens(prompts[row, :length].tolist())
    result = generator.generate_batch([tokens], max_length=32, sampling_topk=1,
                                      include_prompt_in_result=False, **options)[0]
    theirs = np.asarray(result.sequences_ids[0])
    mine = hf_ids[ours[row]]
    eos = tokenizer.eos_token_id
    mine = mine[:list(mine).index(eos) if eos in mine else len(mine)]
    np.testing.assert_array_equal(mine, theirs[:len(mine)])
    assert len(theirs) == len(mine)
    compared += len(mine)
  return compared


def llama_tokenizer(texts, directory, vocab_size):
  """A Llama tokenizer as transformers makes one: a SentencePiece BPE model (byte fallback,
  <unk> 0, <s> 1, </s> 2) that LlamaTokenizer converts to its tokenizer.json, BOS added to every
  text (Llama 2's setting)."""
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
      model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
      character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)
  source = directory / "sentencepiece"
  source.mkdir(parents=True)
  (source / "tokenizer.model").write_bytes(model.getvalue())
  tokenizer = transformers.LlamaTokenizer.from_pretrained(source, add_bos_token=True)
  shutil.rmtree(source)
  return tokenizer


def sentencepiece_model(texts, vocab_size):
  """A unigram SentencePiece model as Marian's are: <unk>, <s>, </s>, no padding piece."""
  proto = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=proto,
                                 vocab_size=vocab_size, model_type="unigram", minloglevel=2,
                                 character_coverage=1.0, hard_vocab_limit=False)
  return proto.getvalue()


def marian_tokenizer(directory, source_texts, target_texts, vocab_size):
  """source.spm and target.spm trained on each side, vocab.json of both as Marian's converter
  writes it (</s> 0, <unk> 1, the pieces, <pad> last); returns the MarianTokenizer."""
  os.makedirs(directory, exist_ok=True)
  vocab = {"</s>": 0, "<unk>": 1}
  for name, texts in (("source.spm", source_texts), ("target.spm", target_texts)):
    proto = sentencepiece_model(texts, vocab_size)
    with open(os.path.join(directory, name), "wb") as f:
      f.write(proto)
    processor = spm.SentencePieceProcessor(model_proto=proto)
    for i in range(processor.get_piece_size()):
      vocab.setdefault(processor.id_to_piece(i), len(vocab))
  for special in ("<s>",):
    vocab.pop(special, None)
  vocab = {piece: i for i, piece in enumerate(vocab)}
  vocab["<pad>"] = len(vocab)
  with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
    json.dump(vocab, f, ensure_ascii=False)
  return transformers.MarianTokenizer(
      source_spm=os.path.join(directory, "source.spm"),
      target_spm=os.path.join(directory, "target.spm"),
      vocab=os.path.join(directory, "vocab.json"))


def marian_config(vocab_size, **changes):
  options = dict(vocab_size=vocab_size, decoder_vocab_size=vocab_size, d_model=32,
                 encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                 max_position_embeddings=64, activation_function="swish", scale_embedding=True,
                 pad_token_id=vocab_size - 1, eos_token_id=0,
                 decoder_start_token_id=vocab_size - 1, forced_eos_token_id=0)
  options.update(changes)
  return transformers.MarianConfig(**options)


EXTRA_IDS = 3  # sentinels <extra_id_0..2> after the SentencePiece pieces


def t5_sentencepiece(texts, vocab_size):
  """A unigram SentencePiece model in T5's layout: <pad> 0, </s> 1, <unk> 2, no BOS."""
  proto = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=proto,
                                 vocab_size=vocab_size, model_type="unigram", minloglevel=2,
                                 character_coverage=1.0, hard_vocab_limit=False, pad_id=0,
                                 eos_id=1, unk_id=2, bos_id=-1)
  return proto.getvalue()


def t5_tokenizer_files(directory, texts, vocab_size):
  """spiece.model and tokenizer_config.json, as a T5 checkpoint ships them; returns the number
  of pieces."""
  os.makedirs(directory, exist_ok=True)
  proto = t5_sentencepiece(texts, vocab_size)
  with open(os.path.join(directory, "spiece.model"), "wb") as f:
    f.write(proto)
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "T5Tokenizer", "extra_ids": EXTRA_IDS}, f)
  return spm.SentencePieceProcessor(model_proto=proto).get_piece_size()


def t5_config(vocab_size, **changes):
  options = dict(vocab_size=vocab_size, d_model=32, d_kv=16, num_heads=3, d_ff=40, num_layers=2,
                 num_decoder_layers=3, relative_attention_num_buckets=8,
                 relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
                 tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
                 eos_token_id=1, dropout_rate=0.0)
  options.update(changes)
  return transformers.T5Config(**options)


def seq2seq_greedy_pairs(ours, hf_ids, reference, source, source_mask, length, **options):
  """(ours, theirs) of each padded source (their ids), each up to its first EOS: our greedy
  continuation (`ours`: our ids, read through `hf_ids`) and the reference's greedy generate of
  `length` tokens after its decoder start token. `options`: more generate arguments."""
  eos = reference.config.eos_token_id
  pairs = []
  for row, n in enumerate(source_mask.sum(1)):
    out = reference.generate(torch.tensor(source[row:row + 1, :n]),
                             attention_mask=torch.ones(1, n, dtype=torch.long),
                             max_new_tokens=length, do_sample=False, num_beams=1, **options)
    theirs = out[0, 1:].numpy()  # after the decoder start token
    theirs = theirs[:list(theirs).index(eos) + 1] if eos in theirs else theirs
    mine = hf_ids[ours[row]]
    mine = mine[:list(mine).index(eos) + 1] if eos in mine else mine
    pairs.append((mine, theirs))
  return pairs
