"""Passwords and tokens in URLs, kept out of everything a run writes or sends.

A URL such as postgresql+psycopg://USER:PASSWORD@HOST/DB (or one with ?password=...) may reach
the command line; from there trackers record it (W&B keeps the command line in its run files),
lock files name their holder's command, and worker processes started with it show it in `ps`.
`redact` is the one place that removes it: the password (or token) becomes ***.
"""

from __future__ import annotations

import re
import sys

# The userinfo password of scheme://USER:PASSWORD@HOST (as SQLAlchemy reads it: the password
# runs to the next "@"), and a query parameter that carries a secret.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*):[^@\s]*@")
_QUERY = re.compile(r"([?&](?:password|passwd|pwd|token|secret|api_key|apikey|access_key|"
                    r"secret_key|sslpassword)=)[^&\s]*", re.IGNORECASE)
SHOWN = "***"


def redact(text: str) -> str:
  """`text` with the password or token of each URL in it replaced by ***."""
  return _QUERY.sub(rf"\1{SHOWN}", _USERINFO.sub(rf"\1:{SHOWN}@", text))


def has_secret(text: str) -> bool:
  return redact(text) != text


def redact_argv() -> None:
  """Removes the secrets of this process's command line (sys.argv) once its flags are parsed:
  trackers record sys.argv (W&B's run files), lock files name their holder's command."""
  sys.argv[:] = [redact(arg) for arg in sys.argv]
