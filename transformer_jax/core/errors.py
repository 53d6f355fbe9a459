"""The one exception type for errors a user can cause and fix."""


class UserError(Exception):
  """A problem the user can fix (bad flag, config value, data or checkpoint).

  The command line (`cli.py`) catches it once, prints `error: <message>` as a single line and
  exits with code 2. The message must name the problem and the fix.
  """
