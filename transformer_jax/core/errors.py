"""The one exception type for errors a user can cause and fix, and the messages it shares."""

import re


class UserError(Exception):
  """A problem the user can fix (bad flag, config value, data or checkpoint).

  The command line (`cli.py`) catches it once, prints `error: <message>` as a single line and
  exits with code 2. The message must name the problem and the fix.
  """


def unknown_key_message(error: Exception, overrides) -> str:
  """One line for an override that names no config key.

  error: the KeyError or AttributeError of ml_collections, whose text is the key in quotes and
  maybe a line `Did you mean "x" instead of "y"?`; overrides: the `--config.KEY=VALUE` flags.
  """
  text = str(error.args[0]) if error.args else str(error)
  # The text may come escaped more than once (a KeyError's repr inside an AttributeError).
  guess = re.search(r'Did you mean "([^"\\]+)" instead of "([^"\\]+)"', text)
  found = re.search(r"[\w-]+", text)
  name = guess.group(2) if guess else (found.group(0) if found else "?")
  flags = [flag for flag in overrides if flag.startswith("--config.")]
  # The flag whose key path holds the unknown name gives the full dotted key.
  flag = next((f for f in flags if name in f.split("=", 1)[0][len("--config."):].split(".")),
              None)
  key = flag.split("=", 1)[0][len("--config."):] if flag else name
  hint = ""
  if guess:
    parts = key.split(".")
    parts[len(parts) - 1 - parts[::-1].index(name) if name in parts else -1] = guess.group(1)
    hint = f" (did you mean {'.'.join(parts)}?)"
  where = f" in {flag}" if flag else (f" in {' '.join(flags)}" if flags else "")
  return (f"unknown config key {key}{where}{hint}; see the experiment file for the keys that "
          "exist")
