"""core/secrets.py: the password or token of a URL is masked wherever it stands in a text, and
nothing else is."""

from transformer_jax.core import secrets


def test_a_urls_password_or_token_is_masked_and_nothing_else():
  masked = {
      "--sweep_storage=postgresql+psycopg://u:pw@h:5432/db":
          "--sweep_storage=postgresql+psycopg://u:***@h:5432/db",
      "postgresql://u:p/w:x@h/db": "postgresql://u:***@h/db",  # SQLAlchemy: up to the "@"
      "http://:tok@h": "http://:***@h",
      "see postgresql://u@h/db?sslmode=require&password=pw": "see postgresql://u@h/db?"
                                                            "sslmode=require&password=***",
      "https://h/x?token=abc&a=1": "https://h/x?token=***&a=1",
  }
  for text, shown in masked.items():
    assert secrets.redact(text) == shown and secrets.has_secret(text), text
  for text in ("gs://bucket/runs/a", "http://127.0.0.1:5000", "sqlite:///sweep.db",
               "postgresql+psycopg://sweeper@h:5432/sweeps", "a:b@c", "user@example.org"):
    assert secrets.redact(text) == text and not secrets.has_secret(text), text
