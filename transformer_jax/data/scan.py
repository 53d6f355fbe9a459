"""SCAN (Lake & Baroni, 2018), generated from its published grammar: no download.

Grammar (commands) and interpretation (action sequences):

  C -> S and S | S after S | S    [[x1 and x2]] = [[x1]] [[x2]]; [[x1 after x2]] = [[x2]] [[x1]]
  S -> V twice | V thrice | V            [[x twice]] = [[x]] x2;  [[x thrice]] = [[x]] x3
  V -> D[1] opposite D[2] | D[1] around D[2] | D | U
  D -> U left | U right | turn left | turn right
  U -> walk | look | run | jump

  [[u dir]] = TURN_dir [[u]];  [[u opposite dir]] = TURN_dir TURN_dir [[u]];
  [[u around dir]] = (TURN_dir [[u]]) x4;  with [[turn]] = nothing, so [[turn left]] = TURN_LEFT.

The grammar admits exactly 20,910 commands. Splits:
  simple: a random 80/20 split with a fixed seed;
  length: train = commands whose action sequence has at most 22 actions, test = the rest. For
    model selection without the test set, the train split is cut once more at `dev_cutoff`
    (data.scan_dev_cutoff) actions: `train_without_dev` holds the train commands with at most
    that many actions, `dev` the train commands with more (up to 22). Selecting on `dev` rewards
    extrapolating past the lengths trained on, as the test split asks, and never reads test.
    The default cutoff, 21, makes `dev` the 576 commands of 22 actions (16,414 left to train
    on); cutoff 16 makes it the 2,848 commands of 17-22 actions (six lengths, up to 1.375 times
    the longest trained on; 14,142 left).
  length_cutoff_C (C in [1, 47]; Newman et al. 2020 and Csordas et al. 2021 use 22-40): the
    length split's rule with the cut at C actions instead of 22: train = the commands whose
    action sequence has at most C actions, test = the rest (length_cutoff_22 is the length
    split; length_cutoff_26 tests the 2,624 commands of 27-48 actions). Its dev is drawn from
    train at random, as Csordas et al.'s code draws theirs: a fixed 10% of the train commands
    (`CUTOFF_DEV_FRACTION`, permuted by `CUTOFF_DEV_SEED`, the same for every run), and
    `train_without_dev` the other 90%. Theirs is also 10% at random, but drawn by another
    generator over the published file's order: the two hold different commands (at cutoff 24,
    say, a different one of the eight 24-action commands "U around D thrice" is held out).
    Being random, this dev measures fit at the trained lengths, not extrapolation; the
    length split's dev (cut by length) is the one to choose options on.

For the tasks other than translation (data/tasks.py) the same parts give texts, "command
actions" (a language model learns to continue a command with its actions, a masked LM to fill
in masked actions), or classes: a command is "long" if its actions are more than 22 (the length
split's rule), else "short".
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

PRIMITIVES = {"walk": "I_WALK", "look": "I_LOOK", "run": "I_RUN", "jump": "I_JUMP", "turn": None}
DIRECTIONS = {"left": "I_TURN_LEFT", "right": "I_TURN_RIGHT"}
SPLITS = ("simple", "length")  # and length_cutoff_C: see `max_train_actions`
PARTS = {"simple": ("train", "test"), "length": ("train", "test", "dev", "train_without_dev")}
LENGTH_SPLIT_MAX_ACTIONS = 22
CUTOFF_PREFIX = "length_cutoff_"
LONGEST_OUTPUT = 48  # actions of the longest command ("jump around left thrice and ..."): 24 + 24
CUTOFF_DEV_FRACTION = 0.1
CUTOFF_DEV_SEED = 0
DEV_CUTOFF = LENGTH_SPLIT_MAX_ACTIONS - 1  # the default of data.scan_dev_cutoff
SIMPLE_SPLIT_SEED = 0
SIMPLE_SPLIT_TRAIN_FRACTION = 0.8


def _verb_phrases():
  """Every V with its actions, as (words, actions) tuples."""
  units = [u for u in PRIMITIVES if u != "turn"]
  for u in units:  # V -> U
    yield (u,), (PRIMITIVES[u],)
  for u in PRIMITIVES:  # V -> D, D[1] opposite D[2], D[1] around D[2]
    act = () if PRIMITIVES[u] is None else (PRIMITIVES[u],)
    for d, turn in DIRECTIONS.items():
      yield (u, d), (turn,) + act
      yield (u, "opposite", d), (turn, turn) + act
      yield (u, "around", d), ((turn,) + act) * 4


def _sentences():
  """Every S: V, V twice, V thrice."""
  for words, actions in _verb_phrases():
    yield words, actions
    yield words + ("twice",), actions * 2
    yield words + ("thrice",), actions * 3


@functools.lru_cache(maxsize=1)
def all_pairs() -> tuple[tuple[str, str], ...]:
  """All (command, actions) pairs the grammar admits, sorted by command."""
  sentences = list(_sentences())
  pairs = [(w, a) for w, a in sentences]
  for (w1, a1), (w2, a2) in itertools.product(sentences, repeat=2):
    pairs.append((w1 + ("and",) + w2, a1 + a2))
    pairs.append((w1 + ("after",) + w2, a2 + a1))
  return tuple(sorted((" ".join(w), " ".join(a)) for w, a in pairs))


def max_train_actions(split: str):
  """The most actions of a train output of `split`: 22 for "length", C for "length_cutoff_C",
  None for "simple" (random, not by length). Raises ValueError for a name that is none of
  these, or a C outside [1, 47] (an empty train or test part)."""
  if split == "simple":
    return None
  if split == "length":
    return LENGTH_SPLIT_MAX_ACTIONS
  if split.startswith(CUTOFF_PREFIX):
    tail = split[len(CUTOFF_PREFIX):]
    if tail.isdigit() and 1 <= int(tail) < LONGEST_OUTPUT:
      return int(tail)
    raise ValueError(f"{split!r}: the cutoff of {CUTOFF_PREFIX}C must be a whole number of "
                     f"actions in [1, {LONGEST_OUTPUT - 1}], e.g. {CUTOFF_PREFIX}26")
  raise ValueError(f"unknown SCAN split {split!r}: simple, length or {CUTOFF_PREFIX}C "
                   f"(C in [1, {LONGEST_OUTPUT - 1}], e.g. {CUTOFF_PREFIX}26)")


def parts(split: str) -> tuple[str, ...]:
  """The parts `load` gives for `split` (ValueError for a bad split, see `max_train_actions`)."""
  return PARTS["simple" if max_train_actions(split) is None else "length"]


def load(split: str, part: str, dev_cutoff: int = DEV_CUTOFF) -> list[tuple[str, str]]:
  """The `part` (see `parts`) of a SCAN `split` ("simple", "length" or "length_cutoff_C");
  `dev_cutoff` (in [1, 21]; the length split only): the most actions of a train_without_dev
  output (see the module docstring)."""
  if not 1 <= dev_cutoff < LENGTH_SPLIT_MAX_ACTIONS:
    raise ValueError(f"dev_cutoff must be in [1, {LENGTH_SPLIT_MAX_ACTIONS - 1}]")
  longest = max_train_actions(split)
  if part not in parts(split):
    raise ValueError(f"unknown SCAN part {part!r}")
  pairs = all_pairs()
  if split == "simple":
    order = np.random.default_rng(SIMPLE_SPLIT_SEED).permutation(len(pairs))
    n_train = int(round(SIMPLE_SPLIT_TRAIN_FRACTION * len(pairs)))
    chosen = order[:n_train] if part == "train" else order[n_train:]
    return [pairs[i] for i in sorted(chosen)]
  actions = [len(a.split()) for _, a in pairs]
  if part == "test":
    return [p for p, n in zip(pairs, actions) if n > longest]
  train = [p for p, n in zip(pairs, actions) if n <= longest]
  if part == "train":
    return train
  if split == "length":  # dev: the longest train outputs
    keep = (lambda n: n > dev_cutoff) if part == "dev" else (lambda n: n <= dev_cutoff)
    return [p for p in train if keep(len(p[1].split()))]
  order = np.random.default_rng(CUTOFF_DEV_SEED).permutation(len(train))
  dev = set(order[:int(CUTOFF_DEV_FRACTION * len(train))].tolist())
  return [p for i, p in enumerate(train) if (i in dev) == (part == "dev")]


@functools.lru_cache(maxsize=1)
def _chunk_lengths() -> dict[tuple[str, ...], int]:
  """Every V's words -> how many actions it means."""
  return {words: len(actions) for words, actions in _verb_phrases()}


def repetitions(command: str) -> list[tuple[int, int]]:
  """(chunk, times) for each S of a command, in the command's order: how many actions its V
  means and how often they repeat ("jump around left thrice" -> [(8, 3)]). Read from the grammar,
  not from the actions: a length split's test outputs differ from train's by which repetitions
  they need (see `repetition_counts`)."""
  chunks = _chunk_lengths()
  out = []
  for sentence in command.replace(" after ", " and ").split(" and "):
    words = tuple(sentence.split())
    times = {"twice": 2, "thrice": 3}.get(words[-1], 1)
    if times > 1:
      words = words[:-1]
    if words not in chunks:
      raise ValueError(f"not a SCAN command: {command!r}")
    out.append((chunks[words], times))
  return out


def repetition_counts(pairs: list[tuple[str, str]]) -> dict[tuple[int, int], int]:
  """For each (chunk, times): how many of the commands hold an S repeating a chunk of that many
  actions that many times (a command with two such S counts once)."""
  counts: dict[tuple[int, int], int] = {}
  for command, _ in pairs:
    for key in set(repetitions(command)):
      counts[key] = counts.get(key, 0) + 1
  return counts


# The two groups of `repetition_groups`: SCAN's length test holds 776 and 3,144 commands.
TRAINED, UNSEEN = "repetitions_trained", "repetition_unseen"


@functools.lru_cache(maxsize=None)
def _trained_repetitions(split: str, part: str, dev_cutoff: int) -> frozenset:
  return frozenset(repetition_counts(load(split, part, dev_cutoff)))


def repetition_groups(commands, split: str, train_part: str = "train",
                      dev_cutoff: int = DEV_CUTOFF) -> list[str]:
  """For each command, TRAINED if every (chunk, times) of its S (see `repetitions`) is in some
  command of `train_part` of `split`, else UNSEEN: a count of repetitions training never showed.
  The length split's test holds 776 of the first and 3,144 of the second ("X around Y thrice":
  24 actions, no train output has them); from length_cutoff_24 on, every test command is of the
  first."""
  trained = _trained_repetitions(split, train_part, dev_cutoff)
  return [TRAINED if set(repetitions(command)) <= trained else UNSEEN for command in commands]


def texts(split: str, part: str, dev_cutoff: int = DEV_CUTOFF) -> list[tuple[str, str]]:
  """(command + " " + actions, "") for each command of the part: text for lm and mlm."""
  return [(f"{command} {actions}", "") for command, actions in load(split, part, dev_cutoff)]


def lengths_classified(split: str, part: str,
                       dev_cutoff: int = DEV_CUTOFF) -> list[tuple[str, str]]:
  """(command, "long" or "short"): whether its actions number more than the split's train
  outputs may (22 for the simple and length splits, C for length_cutoff_C)."""
  longest = max_train_actions(split) or LENGTH_SPLIT_MAX_ACTIONS
  return [(command, "long" if len(actions.split()) > longest else "short")
          for command, actions in load(split, part, dev_cutoff)]
