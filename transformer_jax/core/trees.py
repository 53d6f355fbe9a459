"""Nested dicts (configs, metrics) as flat {"a.b.c": value} mappings."""

from __future__ import annotations

from typing import Any, Mapping


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict:
  """{"a": {"b": 1}} -> {"a.b": 1}; values that are not mappings are leaves."""
  flat = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      flat.update(flatten(value, name + "."))
    else:
      flat[name] = value
  return flat
