"""Riding out a store that goes away for a while: a bucket's endpoint that refuses connections,
cuts them or answers 5xx for a minute (a preemptible job's network blip, a zone's hiccup).

A training run arms it (`arm(train.storage_outage_s)`) once its workdir has answered; from then
on every request that fails because the store does not answer is retried with backoff, on one
clock and one bound: those of `core/storage.py` (`retry`: metrics and events, the lease, the
run's files) and those orbax makes through fsspec for a checkpoint (`retry_async`, in
`storage._riding`); TensorStore, which writes a checkpoint's arrays, retries as long by its own
settings (`train/checkpoint.py`). A checkpoint save that fails all the same is redone or skipped
by `train/checkpoint.py` (`wait_until_answering`). Training goes on meanwhile, up to a save that
must wait for the one before it. The outage is said in one warning line when it begins and one
when it ends. Past the bound the run stops with one UserError naming the endpoint and what it
waited for: what was written before is intact, and the same command resumes from the last
complete checkpoint.

Modes that only read (evaluate, translate, plot, ...) are not armed: they fail at once, in one
line, and are rerun.
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import time
from typing import Callable, Optional

from transformer_jax.core.errors import UserError

DEFAULT_LIMIT_S = 300.0  # train.storage_outage_s's default: "a few minutes"
FIRST_DELAY_S, MAX_DELAY_S = 0.5, 8.0  # the backoff between tries

# Failures of a store that does not answer (or answers that it cannot now), by exception type
# name (aiohttp's, botocore's, gcsfs', Python's) or by their text, which orbax and TensorStore
# wrap in their own exception types. TensorStore (the checkpoints' arrays) reaches the store
# through curl and, once its own tries are spent, says `ABORTED: All N retry attempts failed:
# CURL error Could not connect to server: ... [curl_code='7']` (it retries only what it takes
# for passing: no connection, a cut one, 429 and 5xx).
_NAMES = ("ClientConnectorError", "ClientConnectorDNSError", "ServerDisconnectedError",
          "ClientOSError", "ServerTimeoutError", "EndpointConnectionError", "ConnectTimeoutError",
          "ReadTimeoutError", "ConnectionClosedError", "FSTimeoutError", "TimeoutError",
          "ConnectionError", "ConnectionRefusedError", "ConnectionResetError",
          "BrokenPipeError", "RemoteDisconnected", "IncompleteRead", "ClientConnectionResetError")
_TEXT = re.compile(r"Cannot connect to host|Connect call failed|Connection refused|"
                   r"Server disconnected|Connection reset|Connection aborted|timed out|"
                   r"Cannot write to closing transport|"
                   r"Could not connect to the endpoint|UNAVAILABLE|DEADLINE_EXCEEDED|"
                   r"\b(?:429|500|502|503|504) (?:Too Many|Internal|Bad Gateway|Service|Gateway)|"
                   r"Service Unavailable|SlowDown|RequestTimeout|"
                   r"All \d+ retry attempts failed|Could not connect to server|Couldn't connect|"
                   r"Failed to connect to|Empty reply from server|Recv failure|Send failure|"
                   r"curl_code='?(?:6|7|28|52|55|56)\b", re.IGNORECASE)

_lock = threading.Lock()
_limit = 0.0  # 0: not armed (fail at once)
_gave_up = False  # past the bound once: every later failure gives up at once
_since: Optional[float] = None  # when the current outage's first failure came
_endpoint = ""
_said = False  # whether the current outage was said (see QUIET_S)
_ended = float("-inf")  # when the last outage ended
QUIET_S = 60.0


def arm(seconds: float) -> None:
  """Lets this process's requests wait out an outage of up to `seconds` (0: not at all)."""
  global _limit, _gave_up, _since
  _limit, _gave_up, _since = max(float(seconds), 0.0), False, None


def armed() -> bool:
  return _limit > 0


def unreachable(error: BaseException) -> bool:
  """Whether `error` (or one it was raised from) says the store did not answer, as opposed to
  an answer a user must act on (no permission, no bucket, a precondition)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    code = getattr(error, "code", None) or getattr(error, "status", None)
    if isinstance(code, int) and (code == 429 or 500 <= code < 600):
      return True
    if type(error).__name__ in _NAMES or _TEXT.search(str(error)[:2000]):
      return True
    error = error.__cause__ or error.__context__
  return False


def _began(endpoint: str, error: BaseException) -> float:
  """The outage's start (now, for its first failure, which is said in one warning line unless
  another outage was said less than QUIET_S ago: a store coming back drops a few requests)."""
  global _since, _endpoint, _said
  with _lock:
    if _since is None:
      _since, _endpoint = time.time(), endpoint
      _said = _since - _ended > QUIET_S
      if not _said:
        return _since
      reason = " ".join(str(error).split())[:120] or type(error).__name__
      print(f"warning: {endpoint} does not answer ({type(error).__name__}: {reason}); writes "
            f"wait for it, up to train.storage_outage_s={_limit:.0f} s (training goes on up to "
            "its next checkpoint)", file=sys.stderr, flush=True)
    return _since


def answered() -> None:
  """The store answered: an outage under way is over (said in one line)."""
  global _since, _ended
  with _lock:
    if _since is not None:
      if _said:
        print(f"{_endpoint} answers again after {time.time() - _since:.0f} s; the writes that "
              "waited go on", file=sys.stderr, flush=True)
      _since, _ended = None, time.time()


def ongoing() -> bool:
  return _since is not None


def last_answered() -> float:
  """When the store last answered again after an outage (time.time(); -inf: never)."""
  return _ended


def seen() -> bool:
  """Whether this process met an outage (under way, or over)."""
  return _since is not None or _ended > float("-inf")


def give_up(endpoint: str, waited_for: str) -> UserError:
  """The run's one line past the bound. The process stops waiting from then on: what it still
  does on its way out (releasing its lease) tries once."""
  global _gave_up
  _gave_up = True
  waited = max(time.time() - (_since or time.time()), _limit)
  return UserError(f"{endpoint} did not answer for {waited:.0f} s (train.storage_outage_s="
                   f"{_limit:.0f}) while this run waited {waited_for}; what was written before "
                   "is intact: run the same command once the store answers (it resumes from the "
                   "last complete checkpoint), or raise train.storage_outage_s")


def failed(endpoint: str, error: BaseException, waited_for: str) -> None:
  """Counts a failure that `unreachable` accepts against the bound: raises `give_up` past it
  (and at once, once the process gave up)."""
  since = _began(endpoint, error)
  if _gave_up or time.time() - since > _limit:
    raise give_up(endpoint, waited_for) from None


def retry(fn: Callable, endpoint: str, waited_for: str):
  """fn(), tried again with backoff while it fails because the store does not answer, for up
  to the armed bound of the outage; other failures are raised at once."""
  delay = FIRST_DELAY_S
  while True:
    if _gave_up:  # the run is on its way out: nothing more waits for the store
      raise give_up(endpoint, waited_for)
    try:
      result = fn()
    except Exception as e:  # the libraries raise many types; `unreachable` sorts them
      _counted(e, endpoint, waited_for)
      time.sleep(delay)
      delay = min(delay * 2, MAX_DELAY_S)
      continue
    answered()
    return result


async def retry_async(fn: Callable, endpoint: str, waited_for: str):
  """`retry` for a coroutine function `fn` (the requests of an asyncio filesystem: gcsfs,
  s3fs), on the same bound and clock: its waits let the event loop run."""
  delay = FIRST_DELAY_S
  while True:
    if _gave_up:
      raise give_up(endpoint, waited_for)
    try:
      result = await fn()
    except Exception as e:  # noqa: BLE001  sorted by `unreachable`
      _counted(e, endpoint, waited_for)
      await asyncio.sleep(delay)
      delay = min(delay * 2, MAX_DELAY_S)
      continue
    answered()
    return result


def _counted(error: Exception, endpoint: str, waited_for: str) -> None:
  """A failed try of `retry`: `error` raised again unless the store did not answer in a process
  that rides outages out, where it counts against the bound (`failed`)."""
  if not armed() or not unreachable(error):
    raise error
  failed(endpoint, error, waited_for)


def wait_until_answering(probe: Callable[[], object], endpoint: str, waited_for: str) -> None:
  """Blocks until `probe()` (a cheap request) succeeds, for up to the armed bound."""
  retry(probe, endpoint, waited_for)
